"""torch's own collectives behind our calls: what a Comm with ``collectives="torch"`` runs.

``collectives`` checks a call's arguments, runs it in the same ``header.collective`` context
(counted, and header-checked in a round of its own), and hands it here instead of to one of our
algorithms, with the same signature (``RUNS``, by collective; all_to_all's is that of
``algorithms.all_to_all``), so no caller knows which ran. Each
function calls torch.distributed on the Comm's process group (``comm.group``; None is the world's):
gloo's algorithms on hosts, NCCL's kernels on GPUs. Only groups of two or more ranks get here.

Why the detours around a plain torch call:

* avg is SUM then a division by N: gloo's native AVG is wrong (pytorch issue 162338). All-reduce
  divides here, on every rank alike; reduce-scatter leaves it to ``collectives`` (on the owner).
* uneven ``bounds`` (ZeRO-2/3 buckets cut at partition edges, or numel not divisible by N): torch
  moves equal chunks, so every rank's chunk is padded to the largest one and the padding dropped.
* a tensor on another kind of device than the group's transport (a CUDA tensor over gloo, a host
  value over NCCL) goes through a buffer there, as ``p2p.P2P`` stages ours.
* a failure (a timeout, a lost peer) is raised as ``CollectiveError`` naming the collective and
  the group, so the watchdog diagnoses it as it does ours; torch does not say which peer it lacked.

Bytes sent are not counted (``CommStats.bytes_sent``): torch does not say what its algorithm sends;
calls and seconds are.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist
from torch import Tensor

from distlib.comm.group import Comm
from distlib.comm.p2p import CollectiveError

Bounds = list[tuple[int, int]]  # (start, end) per rank
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


@contextlib.contextmanager
def _failures(kind: str, comm: Comm):
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised with the group named, for the watchdog
        me = comm.rank
        raise CollectiveError(
            f"{kind} (torch's): rank {me} (global {comm.peer(me)}) failed in group {list(comm.ranks)}: {exc}",
            kind,
        ) from exc


def _on_wire(t: Tensor, comm: Comm) -> Tensor:
    """``t`` itself where the transport reads it, else a copy on the transport's device."""
    if t.device.type == torch.device(comm.device).type:
        return t
    pinned = comm.device == "cpu" and t.is_cuda  # the copies are DMA, not through pageable memory
    wire = torch.empty(t.shape, dtype=t.dtype, device=comm.device, pin_memory=pinned)
    return wire.copy_(t)


def _back(wire: Tensor, t: Tensor) -> None:
    if wire is not t:
        t.copy_(wire)


def _buffer(numel: int, like: Tensor, comm: Comm) -> Tensor:
    """A scratch tensor of ``like``'s dtype where the transport reads it."""
    return torch.empty(numel, dtype=like.dtype, device=comm.device)


def _width(bounds: Bounds) -> int:
    return max(b - a for a, b in bounds)


def _even(bounds: Bounds) -> bool:
    """Whether the chunks are equal (they tile the tensor): then torch reads it as it is."""
    return len({b - a for a, b in bounds}) == 1


def all_reduce(flat: Tensor, comm: Comm, op: str) -> None:
    wire = _on_wire(flat, comm)
    with _failures("all_reduce", comm):
        dist.all_reduce(wire, op=_OPS[op], group=comm.group)
    if op == "avg":
        wire.div_(comm.size)
    _back(wire, flat)


def reduce_scatter(flat: Tensor, comm: Comm, op: str, out: Tensor, bounds: Bounds, _seg_bytes: int) -> None:
    """This rank's chunk of the elementwise SUM/MAX/MIN into ``out`` (avg: the sum)."""
    width = _width(bounds)
    if width == 0:  # nothing to reduce anywhere (every rank sees the same bounds)
        return
    if _even(bounds):
        src = _on_wire(flat, comm)
    else:  # rank j's chunk at [j * width, ...), zeros after it
        src = _buffer(comm.size * width, flat, comm).zero_()
        for j, (a, b) in enumerate(bounds):
            src[j * width : j * width + b - a].copy_(flat[a:b])
    got = _buffer(width, flat, comm)
    with _failures("reduce_scatter", comm):
        dist.reduce_scatter_single(got, src, op=_OPS[op], group=comm.group)  # 2.13's reduce_scatter_tensor
    out.copy_(got[: out.numel()])


def all_gather(flat: Tensor, comm: Comm, bounds: Bounds, _seg_bytes: int) -> None:
    """Every rank's chunk (already at ``bounds[rank]`` of ``flat``) into ``flat`` on every rank."""
    width = _width(bounds)
    if width == 0:
        return
    lo, hi = bounds[comm.rank]
    mine = _buffer(width, flat, comm).zero_()  # a copy: torch's input never aliases its output
    mine[: hi - lo].copy_(flat[lo:hi])
    even = _even(bounds)
    wire = _on_wire(flat, comm) if even else _buffer(comm.size * width, flat, comm)
    with _failures("all_gather", comm):
        dist.all_gather_single(wire, mine, group=comm.group)  # 2.13's all_gather_into_tensor
    if even:
        _back(wire, flat)
        return
    for j, (a, b) in enumerate(bounds):
        flat[a:b].copy_(wire[j * width : j * width + b - a])


def broadcast(flat: Tensor, src: int, comm: Comm, _seg_bytes: int) -> None:
    wire = _on_wire(flat, comm)
    with _failures("broadcast", comm):
        dist.broadcast(wire, src=comm.peer(src), group=comm.group)
    _back(wire, flat)


def all_to_all(send: Tensor, recv: Tensor, comm: Comm, send_bounds: Bounds, recv_bounds: Bounds) -> None:
    """Piece j of ``send`` (at ``send_bounds[j]``) to rank j; rank i's piece into ``recv_bounds[i]``
    (the signature of ``algorithms.all_to_all``'s). torch takes the pieces back to back, in rank
    order, so they are packed and unpacked around it."""
    sent, got = [b - a for a, b in send_bounds], [b - a for a, b in recv_bounds]
    src = _on_wire(torch.cat([send[a:b] for a, b in send_bounds]), comm)
    dst = _buffer(sum(got), recv, comm)
    with _failures("all_to_all", comm):
        dist.all_to_all_single(dst, src, got, sent, group=comm.group)
    for (a, b), start in zip(recv_bounds, itertools.accumulate(got, initial=0)):
        recv[a:b].copy_(dst[start : start + b - a])


# by collective: the function ``collectives`` runs in place of one of our algorithms (same signature)
RUNS = {
    "all_reduce": all_reduce,
    "reduce_scatter": reduce_scatter,
    "all_gather": all_gather,
    "broadcast": broadcast,
    "all_to_all": all_to_all,
}
