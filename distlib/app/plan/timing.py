"""A layout's step time, predicted: what one step of each pipeline stage computes and sends,
priced by a few constants of this machine.

What a step does comes from the dry step the activation prediction already runs (``activations``:
the trainer's own step program on the meta device over dry groups), counted as it runs
(``Counted``): the floating-point operations of every operator (torch's formulas), the operators
dispatched, the bytes they write, and every collective and pipeline send of the dry groups
(``comm.tally``); to which ``report.predicted_time`` adds the ZeRO stage's own collectives per
parameter group (``zero.predict.sync_parts``), the verdict's all-gather and the optimizer update
(its elements).

What they cost (``Machine``, measured in this process by ``Machine.probe``): a matrix multiply's
FLOP rate, the time an operator costs beyond its arithmetic (a small MLP's forward and backward,
whose arithmetic is negligible: the per-operator cost dominates this project's small models on a
CPU), a written byte (a 4 MB add), an AdamW element's update, and the cores. A collective over
the shared-memory board costs a meeting of its ranks (``BOARD_MEET_S`` for two, more where the
job's ranks outnumber the cores) and its bytes; over gloo's pairs, ``comm.cost_model``'s price
for the algorithm it would choose; a pipeline send, one message. A GPU kind is priced on its data
sheet instead (``devices``).

    own work  = FLOPs / rate + operators x op cost + bytes written x byte cost
                + update elements x update cost                                 (per stage)
    compute   = max(the slowest stage's own work, all ranks' own work / cores)
    bubble    = what the critical path, the slowest stage's forward and backward x
                (m v + pp - 1) / (m v), adds beyond the compute  (m micro-batches, v chunks a rank)
    step      = compute + bubble + the slowest stage's collectives and sends

(ranks that wait, a pipeline's in its bubble, leave their core to the others). With
``zero.overlap`` each of the optimizer's collectives is handed to the communication thread: a
wake-up more (``handoff``), and nothing credited for hiding (measured on 2 cores, the thread makes
a 4-rank step slower, not faster: no core is idle to run it).

What it leaves out: the hiding overlap gives where cores are idle, the CPU's caches, the grad norm's
small all-gather; document masks over context-parallel ranks are not predicted (where the tokens go
follows the documents), and models with experts are priced at balanced loads (the router decides
the real ones). ``benchmarks/plan_time.py`` measures how well it ranks real layouts.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from distlib.app.plan import meta_memo
from distlib.comm import cost_model


@dataclass(frozen=True)
class Counted:
    """One dry step of a pipeline stage's first rank: its arithmetic, operators and messages."""

    flops: int
    ops: int
    written: int  # bytes the operators wrote (new tensors and in-place results; views write none)
    # (kind, bytes, group size, times): its collectives and sends, equal ones counted together
    # (``grouped``: a deep model's ZeRO-3 step over many micro-batches makes thousands)
    calls: tuple[tuple[str, int, int, int], ...]


def grouped(calls) -> tuple[tuple[str, int, int, int], ...]:
    """``calls`` ((kind, bytes, group size) each) with equal ones as one, and how many times, in
    the order first seen."""
    return merged(tuple((*call, 1) for call in calls))


def times(calls: tuple, n: int) -> tuple[tuple[str, int, int, int], ...]:
    """Grouped ``calls`` made ``n`` times."""
    return tuple((kind, nbytes, size, t * n) for kind, nbytes, size, t in calls)


def merged(*parts) -> tuple[tuple[str, int, int, int], ...]:
    """Grouped calls of several ``parts`` as one, the times of equal calls added."""
    counts: dict = {}
    for part in parts:
        for kind, nbytes, size, n in part:
            counts[(kind, nbytes, size)] = counts.get((kind, nbytes, size), 0) + n
    return tuple((*call, n) for call, n in counts.items())


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched below it (every aten call of a forward and backward), their
    floating-point operations (torch's formulas, ``flop_registry``: the matrix products and
    attention kernels; ``FlopCounterMode`` gives the same totals on every family and dimension
    tried, at 1.4x the time: it tracks modules and decomposes what has no formula), and the bytes
    they write: each result that is not a view of an input.

    With ``memory`` (a dict kept across dry steps) it also answers an operator on the meta device
    it has seen with the same inputs as ``meta_memo.MetaMemo`` does, counted as it was the first
    time: one mode where a ``MetaMemo`` beneath made two. With ``results``
    (``dry_inputs.cpu_results``) it takes an operator's results as that gives them: the CPU's
    kernels' where they differ, without a mode of their own beneath. A 2-block mixtral_tiny unit
    (its model's build included) took 38.7 ms through three modes in fp32, 49.4 in bf16; through
    this one 21.8 and 23.5 (best of six, one process)."""

    def __init__(self, memory: dict | None = None, results=None) -> None:
        super().__init__()
        self.ops = 0
        self.flops = 0
        self.written = 0
        self.memory = memory
        self.results = results

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = meta_memo.key_of(func, args, kwargs) if self.memory is not None else None
        seen = self.memory.get(key) if key is not None else None
        if seen is not None:
            described, flops, written = seen
            self._add(flops, written)
            return meta_memo.made(described)
        out = func(*args, **kwargs)
        if self.results is not None:
            out = self.results(func, args, out)
        flops, written = _counts(func, args, kwargs, out)
        self._add(flops, written)
        if key is not None:
            meta_memo.remember(self.memory, key, out, flops, written)
        return out

    def _add(self, flops: int, written: int) -> None:
        self.ops += 1
        self.flops += flops
        self.written += written


def _counts(func, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """An operator call's floating-point operations and the bytes its results ``out`` write."""
    formula, writes = _operator(func)
    flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
    results = out if isinstance(out, (tuple, list)) else (out,)
    written = 0
    for writing, result in zip(writes, results):
        if writing and isinstance(result, torch.Tensor):
            written += result.numel() * result.element_size()
    return flops, written


_OPERATORS: dict = {}  # operator -> (its FLOP formula or None, which of its results it writes)


def _operator(func) -> tuple:
    """What ``OpCounter`` needs of an operator, looked up once per operator, not once per call."""
    known = _OPERATORS.get(func)
    if known is None:
        writes = tuple(r.alias_info is None or r.alias_info.is_write for r in func._schema.returns)
        known = _OPERATORS[func] = (flop_registry.get(func._overloadpacket), writes)
    return known


@dataclass(frozen=True)
class Machine:
    flops: float  # FLOP/s of one process with a core to itself (fp32 matmul)
    op_s: float  # seconds an operator costs beyond its arithmetic
    byte_s: float  # seconds per byte an operator writes (reading its inputs included)
    update_s: float  # seconds to update one optimizer element (AdamW, fp32 state)
    cores: int  # the ranks beyond these share them
    name: str = field(default="this machine", compare=False)
    link: object | None = None  # a GPU kind's collectives (``devices.Link``); None: this host's

    @staticmethod
    def probe() -> Machine:
        """This process's figures on one thread, as a rank runs (``train.py`` sets one per rank;
        more would also start a thread pool in the launcher), the best of a few short runs each
        (about 0.1 s in all)."""
        from distlib.app.observe.throughput import probe_flops

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            rate = probe_flops(torch.device("cpu"))
            return Machine(rate, _op_seconds(rate), _byte_seconds(), _update_seconds(), cores)
        finally:
            torch.set_num_threads(threads)

    def stretch(self, world_size: int) -> float:
        """How much longer a rank's own work takes when ``world_size`` ranks share the cores."""
        return max(1.0, world_size / self.cores)

    def collective_s(
        self, kind: str, nbytes: int, size: int, world_size: int, transport: str = "shm"
    ) -> float:
        """One collective (or a send: one message of ``nbytes``) on a group of ``size`` ranks of a
        job of ``world_size``, over the shared-memory board (``dist.transport=shm``) or gloo's
        pairs (the cost model's), or a GPU kind's links."""
        if self.link is not None:
            return self.link.collective_s(kind, nbytes, size)
        if kind == "handoff":  # a collective handed to the communication thread (zero.overlap)
            return BOARD_MEET_S * self.stretch(world_size)
        if transport == "shm":
            return self._board_s(kind, nbytes, size, world_size)
        if kind == "send":
            return cost_model.estimate("broadcast", "flat", nbytes, 2)
        if kind not in cost_model.CANDIDATES:  # all_to_all, object gathers: messages to every peer
            return cost_model.estimate("all_gather", "direct", nbytes, size)
        algo = cost_model.choose_algorithm(kind, nbytes, size)
        return cost_model.estimate(kind, algo, nbytes, size)

    def _board_s(self, kind: str, nbytes: int, size: int, world_size: int) -> float:
        """A board collective: a meeting of ``size`` ranks, each waking the others (where the
        job's ranks outnumber the cores, a wake-up waits for a core: the job's stretch, not the
        group's), then the bytes copied in and out (an all-reduce twice: its reduce-scatter and
        its gather)."""
        ranks = 2 if kind == "send" else size
        stretch = self.stretch(world_size)
        copies = 2 if kind == "all_reduce" else 1
        return BOARD_MEET_S * ranks / 2 * stretch + nbytes * copies * BOARD_BYTE_S * stretch


# The board's costs on a 2-core AMD EPYC (AVX-512), quiet (benchmarks/collectives.py --worlds 2 4,
# 1 KB - 1 MB, the shm column): a collective of 2 ranks takes 0.11-0.14 ms at 1-64 KB, of 4
# ranks (2 per core) 0.41-0.49 ms; 1 MB adds about 0.1 ms per copy of it at 2 ranks.
BOARD_MEET_S = 0.13e-3
BOARD_BYTE_S = 0.1e-9


def _op_seconds(rate: float, repeats: int = 5) -> float:
    """An operator's cost beyond its arithmetic: a small MLP's forward and backward (a few hundred
    operators on 8 x 32 activations), its time less its FLOPs at ``rate``, per operator."""
    torch.manual_seed(0)
    mlp = nn.Sequential(*[nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(8)])
    x = torch.ones(8, 32)

    def step() -> None:
        mlp(x).sum().backward()

    counter = OpCounter()
    with counter:
        step()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - began)
    return max(best - counter.flops / rate, 0.0) / counter.ops


def _byte_seconds(numel: int = 1 << 20, repeats: int = 5) -> float:
    """A byte an elementwise operator writes: the sum of two 4 MB tensors into a third (8 MB read,
    4 MB written; beyond the caches of most cores), the best of ``repeats``, per byte written."""
    a, b, out = torch.full((numel,), 0.5), torch.full((numel,), 0.25), torch.empty(numel)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        torch.add(a, b, out=out)
        best = min(best, time.perf_counter() - began)
    return best / (4 * numel)


def _update_seconds(numel: int = 1 << 16, repeats: int = 3) -> float:
    """One AdamW element's update (``parallel.adamw``, fp32), the best of ``repeats``."""
    from distlib.parallel.adamw import AdamWConfig, adamw_step_

    cfg = AdamWConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    param, grad, m, v = (torch.full((numel,), 0.5) for _ in range(4))
    best = float("inf")
    for step in range(1, repeats + 1):
        began = time.perf_counter()
        adamw_step_(param, grad, m, v, step, cfg)
        best = min(best, time.perf_counter() - began)
    return best / numel


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # the slowest stage's own work, stretched by the ranks sharing cores
    comm_s: float  # that stage's collectives and sends
    bubble_s: float  # the pipeline's idle time
    tokens: int  # per step, all ranks

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.bubble_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "step_ms": 1e3 * self.total_s,
            "compute_ms": 1e3 * self.compute_s,
            "comm_ms": 1e3 * self.comm_s,
            "bubble_ms": 1e3 * self.bubble_s,
            "tokens_per_s": self.tokens_per_s,
        }


def step_time(
    stages: list[tuple[Counted, int]],
    world_size: int,
    stage_ranks: int,
    micro_batches: int,
    chunks: int,
    tokens: int,
    machine: Machine,
    transport: str = "shm",
) -> StepTime:
    """The step of ``stages`` (per pipeline stage: its dry step's counts with the ZeRO and
    verdict collectives added, and its optimizer elements) of ``world_size`` ranks, ``stage_ranks``
    a stage, on ``machine``; ``micro_batches`` and ``chunks``: the pipeline's m and v (each 1
    without a pipeline).

    A rank's own work (forward, backward, update) takes at least its time alone; the ranks
    together take at least all their work over the cores (ranks that wait, a pipeline's in its
    bubble, leave their core to the others); the pipeline's critical path is its slowest stage's
    forward and backward stretched by the bubble, (m v + pp - 1) / (m v), then the update. The
    compute is the larger of the first two; what the critical path adds beyond it is the bubble."""
    pp = len(stages)
    own, forward_backward, sent = [], [], []
    for counted, elements in stages:
        work = counted.flops / machine.flops + counted.ops * machine.op_s + counted.written * machine.byte_s
        forward_backward.append(work)
        own.append(work + elements * machine.update_s)
        sent.append(
            sum(
                count * machine.collective_s(kind, n, size, world_size, transport)
                for kind, n, size, count in counted.calls
            )
        )
    slots = micro_batches * chunks
    update = max(o - f for o, f in zip(own, forward_backward))
    critical = max(forward_backward) * (slots + pp - 1) / slots + update
    compute = max(max(own), sum(own) * stage_ranks / machine.cores)
    return StepTime(compute, max(sent), max(0.0, critical - compute), tokens)
