"""Small values all ranks must agree on: metrics to log and decisions to take.

The training loop uses these instead of collectives: a mean loss for the log,
a per-rank vector for checks, one verdict for a control-flow decision (which
every rank must take identically, or the ranks diverge and deadlock).
They are host values (Python numbers in, Python numbers out), so their tensors are on the CPU
whatever device the model is on; over NCCL ``p2p.P2P`` stages them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

import torch

from distlib.comm import collectives
from distlib.comm.group import Comm


def mean(value: float, comm: Comm) -> float:
    """Mean of a float over ranks (SUM then divide, never a native AVG)."""
    t = torch.tensor([value], dtype=torch.float64, device="cpu")
    return float(collectives.all_reduce(t, comm, op="sum")[0]) / comm.size


def gather(values: list[float], comm: Comm) -> list[list[float]]:
    """Every rank's ``values`` (same length on all ranks), indexed by rank, on every rank."""
    width = len(values)
    out = torch.zeros(comm.size * width, dtype=torch.float64, device="cpu")
    collectives.all_gather(out, torch.tensor(values, dtype=torch.float64, device="cpu"), comm)
    return out.view(comm.size, width).tolist() if width else [[] for _ in range(comm.size)]


def all_true(flag: bool, comm: Comm) -> bool:
    """True on every rank iff ``flag`` is true on every rank."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device="cpu")
    return bool(collectives.all_reduce(t, comm, op="min")[0])


def gather_bytes(payload: bytes, comm: Comm) -> list[bytes]:
    """Every rank's small blob (an error text, a JSON report), indexed by rank, on every rank."""
    return collectives.all_gather_bytes(payload, comm)


def gather_parts(parts: list[list[float]], comm: Comm) -> list[list[list[float]]]:
    """Several components' per-rank vectors in one ``gather``: each part's rows (one per rank)
    back, in the order given. The widths must be the same on every rank (each is fixed by its
    component), so every rank splits the same gathered rows the same way."""
    widths = [len(p) for p in parts]
    rows = gather([x for p in parts for x in p], comm)
    ends = [sum(widths[: i + 1]) for i in range(len(widths))]
    return [[row[end - w : end] for row in rows] for w, end in zip(widths, ends)]


T = TypeVar("T")


def agreed(fn: Callable[[], T], comm: Comm, error: type[Exception], *, rank0_only: bool = False) -> T | None:
    """ "Decide, and every rank hears": run ``fn`` on every rank (or on rank 0 only, whose result --
    JSON-serialisable then -- every rank receives), in one collective. If it raised anywhere, every
    rank raises the same ``error`` naming the failed ranks, so none goes on alone or waits forever."""
    runs = comm.rank == 0 or not rank0_only
    value, shared = _run_and_share(fn, comm, error, runs=runs, share=rank0_only and comm.rank == 0)
    return shared[0] if rank0_only else value


def agreed_all(fn: Callable[[], T], comm: Comm, error: type[Exception]) -> list[T]:
    """``agreed`` where every rank runs ``fn`` and every rank receives all the (JSON-serialisable)
    results, indexed by rank: the same one collective carries the results and the verdict."""
    return _run_and_share(fn, comm, error, runs=True, share=True)[1]


def _run_and_share(
    fn: Callable[[], T], comm: Comm, error: type[Exception], *, runs: bool, share: bool
) -> tuple[T | None, list]:
    value, problem = None, ""
    if runs:
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - shared below, raised everywhere
            problem = str(exc) if isinstance(exc, error) else f"{type(exc).__name__}: {exc}"
    mine = {"error": problem, "value": value if share and not problem else None}
    reports = [json.loads(b) for b in collectives.all_gather_bytes(json.dumps(mine).encode(), comm)]
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
    if len({e for _, e in failed}) == 1:
        raise error(failed[0][1])
    if failed:
        raise error("; ".join(f"rank {r}: {e}" for r, e in failed))
    return value, [rep["value"] for rep in reports]
