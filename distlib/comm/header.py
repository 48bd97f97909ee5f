"""What every outermost collective does around its algorithm: count it, and check that all ranks
called the same one.

``collective(comm, kind, ...)`` is the context each public collective runs its algorithm in.
With ``comm.stats`` it counts the call, and the seconds it took, under ``kind`` (the bytes are
counted by ``P2P`` as they are sent); nested collectives (an all_reduce built from reduce_scatter
+ all_gather) pass straight through, so each outermost call counts once. With ``comm.check`` it
first exchanges a small fixed-size header with every member -- call number, kind, numel, dtype,
op, src, algorithm and a checksum of explicit bounds, each as an int64 code -- so ranks whose calls
differ all raise the same ``CollectiveMismatchError`` describing each rank's call, instead of gloo
aborting the process, a wait that never ends, or a silently truncated message.
"""
from __future__ import annotations

import contextlib
import time
import zlib

import torch

from distlib.comm.group import KINDS, Comm
from distlib.comm.p2p import P2P, CollectiveMismatchError

OPS = ("sum", "avg", "max", "min")
ALGOS = ("direct", "ring", "exchange", "tree", "chain")
# The header's codes by index; a value outside a table is coded by a checksum (>= 1000), which
# still mismatches correctly and is printed as the raw code.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)


def check_op(op: str, dtype: torch.dtype) -> None:
    """A reduction op every collective knows (and the header can code), valid for ``dtype``."""
    if op not in OPS:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {OPS}")
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"op 'avg' needs a floating dtype, got {dtype}")


def _code(value, table) -> int:
    return -1 if value is None else table.index(value) if value in table else 1000 + zlib.crc32(str(value).encode()) % 10**6


def _describe(header: list[int]) -> str:
    """One rank's call in words; ``header`` is the list ``collective`` builds, in this order."""
    call, kind, numel, dtype, op, src, algo, layout = header
    parts = [f"numel={numel}"] if numel >= 0 else []
    parts += [f"dtype={str(_DTYPES[dtype]).replace('torch.', '') if 0 <= dtype < len(_DTYPES) else dtype}"
              ] if dtype >= 0 else []
    parts += [f"op={OPS[op] if op < len(OPS) else op}"] if op >= 0 else []
    parts += [f"src={src}"] if src >= 0 else []
    parts += [f"algo={ALGOS[algo] if algo < len(ALGOS) else algo}"] if algo >= 0 else []
    parts += [f"bounds#{layout}"] if layout >= 0 else []
    name = KINDS[kind] if 0 <= kind < len(KINDS) else f"kind#{kind}"
    return f"{name}({', '.join(parts)})" + (f" as collective #{call}" if call >= 0 else "")


def check_header(comm: Comm, kind: str, header: list[int]) -> None:
    """Exchange ``header`` with every member (fixed size, so it cannot mismatch itself) and raise
    the same CollectiveMismatchError on every rank if any member's differs."""
    p2p, me = P2P(f"{kind} (header check)", comm), comm.rank
    mine = torch.tensor(header, dtype=torch.int64, device="cpu")
    parts = [mine if j == me else torch.empty_like(mine) for j in range(comm.size)]
    handles = [p2p.recv(parts[j], j) for j in range(comm.size) if j != me]
    handles += [p2p.send(mine, j) for j in range(comm.size) if j != me]
    p2p.wait(*handles)
    headers = [p.tolist() for p in parts]
    if any(h != headers[0] for h in headers):
        calls = "; ".join(f"rank {j} (global {comm.peer(j)}) called {_describe(h)}" for j, h in enumerate(headers))
        raise CollectiveMismatchError(f"{kind}: mismatched collective in group {list(comm.ranks)}: {calls}", kind)


@contextlib.contextmanager
def collective(comm: Comm, kind: str, *, numel: int = -1, dtype: torch.dtype | None = None,
               op: str | None = None, src: int = -1, algo: str | None = None,
               bounds: list[tuple[int, int]] | None = None):
    """Count (comm.stats) and check (comm.check) the outermost collective; nested ones pass through.
    Explicit uneven ``bounds`` are part of the call (a checksum of them), so ranks that split a
    buffer differently fail here instead of truncating a message or waiting forever."""
    stats = comm.stats
    if stats is not None and stats.depth:
        stats.depth += 1
        try:
            yield
        finally:
            stats.depth -= 1
        return
    kind = kind if kind in KINDS else "other"
    began = time.perf_counter()
    if stats is not None:
        stats.depth, stats.current = 1, kind
    # Under torch.profiler each outermost collective is a named range (train.profile_steps); the
    # check when none collects is one C call (~0.1 us).
    named = (torch.profiler.record_function(range_name(kind, algo, numel, dtype))
             if torch.autograd._profiler_enabled() else contextlib.nullcontext())
    try:
        with named:
            if comm.check:
                call = stats.total_calls if stats is not None else -1
                check_header(comm, kind, [call, KINDS.index(kind), numel, _code(dtype, _DTYPES),
                                          _code(op, OPS), src, _code(algo, ALGOS),
                                          -1 if bounds is None else zlib.crc32(repr(bounds).encode())])
            yield
    finally:
        if stats is not None:
            stats.depth, stats.current = 0, "other"
            stats.calls[kind] += 1
            stats.seconds[kind] += time.perf_counter() - began


RANGE_PREFIX = "collective:"


def range_name(kind: str, algo: str | None, numel: int, dtype: torch.dtype | None) -> str:
    """The profiler range of one collective: ``collective:<kind> algo=<algorithm> bytes=<payload>``
    (the payload is numel x element size; omitted where the call does not say)."""
    name = f"{RANGE_PREFIX}{kind} algo={algo or 'default'}"
    if numel >= 0 and dtype is not None:
        name += f" bytes={numel * dtype.itemsize}"
    return name
