"""What a pipeline step really did: timed events per action and activation memory per rank.

``Recorder`` is handed to ``executor.run``; it keeps one event per action --
(rank, kind, micro, chunk, t_start, t_end) in ``time.perf_counter`` seconds, which on Linux is
CLOCK_MONOTONIC, one clock for every process of a machine -- with t_start taken once the inputs
arrived, so waiting is idle time, and t_end once the outputs were sent. It also measures the
activation memory of the in-flight micro-batches: the bytes autograd saves for backward during a
chunk's forward (parameters excluded, each tensor once) plus the chunk's input and output,
held from the forward to its backward.

``bubble`` turns the events of all ranks of one step into each rank's idle fraction, to be set
against ``theory``: (P-1)/(m+P-1) for GPipe and 1F1B, (P-1)/(v*m+P-1) interleaved.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
from torch import nn


class Recorder:
    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[dict] = []
        self.live_bytes = self.peak_bytes = 0
        self.in_flight = self.peak_in_flight = 0
        self.peak_sends = 0  # most sent tensors held at once, waiting for their wait
        self._held: dict[tuple[int, int], int] = {}
        self.clock = time.perf_counter

    def event(self, kind: str, micro: int, chunk: int, t_start: float, t_end: float) -> None:
        self.events.append(
            dict(rank=self.rank, kind=kind, micro=micro, chunk=chunk, t_start=t_start, t_end=t_end)
        )

    @contextlib.contextmanager
    def forward(self, micro: int, chunk: int, module: nn.Module, held: list):
        """Count what the forward inside saves for backward; ``held`` gets the tensors the
        executor keeps (input, output) appended before the block ends."""
        # Tensors by where they start (storage, byte offset): what their addresses say, on the meta
        # device too (every meta tensor's address is 0), where the planner runs this program.
        params = {p.untyped_storage()._cdata for p in module.parameters()}
        seen: dict[tuple[int, int], int] = {}
        alive: dict[int, weakref.ref] = {}  # the storages counted, while they live

        def forget(key: int) -> None:
            """A saved tensor freed before the forward ended (its branch of the graph dropped: an
            output nothing used) is not held for the backward, and its key may name a new storage
            next (DeepSeek-V3's counts varied by ~0.3% from run to run before)."""
            alive.pop(key, None)
            for at in [at for at in seen if at[0] == key]:
                del seen[at]

        def count(t: torch.Tensor) -> None:  # a view counts its own bytes, not its whole storage
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in params:
                if key not in alive:
                    alive[key] = weakref.ref(storage, lambda _, key=key: forget(key))
                at = (key, t.storage_offset() * t.element_size())
                seen[at] = max(seen.get(at, 0), t.numel() * t.element_size())

        def pack(t: torch.Tensor):
            count(t)
            return t.detach()  # same storage; a saved output kept with its grad_fn would form a cycle

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        for t in held:
            count(t)
        nbytes = sum(seen.values())
        alive.clear()  # (what dies from here on was held and is let go by its backward)
        self._held[(micro, chunk)] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def pending_sends(self, count: int) -> None:
        self.peak_sends = max(self.peak_sends, count)

    def backward_done(self, micro: int, chunk: int) -> None:
        self.live_bytes -= self._held.pop((micro, chunk))
        self.in_flight -= 1

    def summary(self) -> dict:
        return dict(
            rank=self.rank, peak_bytes=self.peak_bytes, peak_in_flight=self.peak_in_flight, events=self.events
        )


def theory(name: str, P: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction, equal forward and backward times per stage assumed away
    (it cancels): (P-1)/(m+P-1), and (P-1)/(v*m+P-1) for the interleaved schedule."""
    return (P - 1) / ((v if name == "interleaved" else 1) * m + P - 1)


def bubble(events: list[dict]) -> dict[int, float]:
    """Per rank: the fraction of the step (first start to last end over all ranks) not spent
    in an action."""
    t0 = min(e["t_start"] for e in events)
    span = max(e["t_end"] for e in events) - t0
    busy: dict[int, float] = {}
    for e in events:
        busy[e["rank"]] = busy.get(e["rank"], 0.0) + e["t_end"] - e["t_start"]
    return {r: 1.0 - b / span for r, b in sorted(busy.items())}
