"""Hand-written collectives on torch.distributed point-to-point (isend/irecv).

Every function takes a ``Comm`` and talks only to its members, addressing them by global
rank (``comm.peer(i)``) on ``comm.group``. Our algorithms never call torch's own collectives;
those are the reference in the tests and the benchmark, and what a Comm with
``collectives="torch"`` runs instead of our algorithms (``native``: the same calls, argument
checks and header check; ``algo=`` then does not apply).

The algorithms live in ``distlib.comm.algorithms`` (one module per collective); the default for
tensor bytes B on N ranks is the cheapest in ``cost_model`` (its docstring has the table of
levels, bytes sent and bytes reduced per rank of each, and why its constants are committed
rather than probed), and each public function takes ``algo=`` to force one, which the tests do
at every size:

| collective     | algorithms (``algo=``)                      |
|----------------|---------------------------------------------|
| all_reduce     | exchange, direct, ring, rabenseifner        |
| reduce_scatter | direct, ring, halving                       |
| all_gather     | direct, ring, bruck                         |
| broadcast      | flat, tree, chain, scatter (van de Geijn)   |
| all_to_all     | direct, pairwise                            |

Bitwise agreement: after all_reduce, broadcast and all_gather every rank holds identical
bytes. Direct, ring and halving reduce-scatter reduce each element on exactly one rank (its
owner) and all-gather then copies it; exchange has every rank reduce all N contributions in the
same rank order 0..N-1 (which direct reduce-scatter also uses, so exchange and direct
all_reduce agree with each other too). Ring and rabenseifner add in other, fixed orders. avg =
sum, then divide by N (on the owner).

Uneven splits: reduce_scatter and all_gather take ``bounds=`` (one contiguous (start, end)
per rank, possibly empty), so ZeRO-2/3 can reduce a bucket straight into each rank's
partition; the default is the even split of ``chunk_bounds``.

Devices: temporaries are allocated where the tensor lives; ``p2p.P2P`` stages tensors (CUDA over
gloo) and, with NCCL (``comm.batched``), posts a round's messages as one batch.

Underneath: ``p2p.P2P`` posts the messages and turns a failed wait (a peer that timed out or
died) into ``CollectiveError`` naming the collective, this rank and the peer; every outermost
call runs in ``header.collective``, which counts it (``comm.stats``) and, with ``comm.check``,
raises the same ``CollectiveMismatchError`` on every rank when ranks called different ones.
A group whose members share a host has a board (``board``): there each algorithm runs as
``algorithms.reads`` (parts written once, read by every member after a barrier), adding in the
algorithm's own order, so the bytes are the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

from distlib.comm import cost_model, native
from distlib.comm.algorithms import all_gather as AG
from distlib.comm.algorithms import broadcast as BC
from distlib.comm.algorithms import reduce_scatter as RS
from distlib.comm.algorithms.base import chunk_bounds, fold
from distlib.comm.algorithms.base import empty as _empty
from distlib.comm.exchange import all_to_all  # noqa: F401 - the collectives' one namespace
from distlib.comm.execution import execution as _execution
from distlib.comm.execution import flat as _flat
from distlib.comm.execution import nothing as _nothing
from distlib.comm.group import Comm
from distlib.comm.header import collective
from distlib.comm.header_codes import check_op
from distlib.comm.p2p import P2P

SEGMENT_BYTES = 1 << 20  # pipeline granularity of ring / chain
MODEL = cost_model.MEASURED  # what choose_algorithm prices the candidates with


def choose_algorithm(collective: str, nbytes: int, world: int) -> str:
    """The algorithm a collective uses by default for ``nbytes`` on ``world`` ranks: the cheapest
    in the committed cost model ``MODEL`` (``cost_model``), identical on every rank and run."""
    return cost_model.choose_algorithm(collective, nbytes, world, MODEL)


def _pick(collective: str, algo: str | None, flat: Tensor, comm: Comm, table: dict):
    if comm.dry:
        return "dry", _nothing
    if comm.collectives == "torch":  # torch's own collective in place of our algorithms
        return "torch", native.RUNS[collective]
    name = algo or choose_algorithm(collective, flat.numel() * flat.element_size(), comm.size)
    if name not in table:
        raise ValueError(f"unknown {collective} algorithm {name!r}; expected one of {sorted(table)}")
    return name, _execution(collective, name, comm, table)


def _check_bounds(
    bounds: list[tuple[int, int]] | None, numel: int, comm: Comm, name: str
) -> list[tuple[int, int]]:
    """``bounds`` (one (start, end) per rank, contiguous, covering the tensor, possibly empty or
    uneven) or, when None, the even split of chunk_bounds."""
    if bounds is None:
        return chunk_bounds(numel, comm.size)
    bounds = [(int(a), int(b)) for a, b in bounds]
    ends = [0] + [b for _, b in bounds]
    if (
        len(bounds) != comm.size
        or any(a != e or b < a for (a, b), e in zip(bounds, ends))
        or ends[-1] != numel
    ):
        raise ValueError(
            f"{name}: bounds {bounds} must be {comm.size} contiguous (start, end) pairs covering [0, {numel})"
        )
    return bounds


# --------------------------------------------------------------------------- reduce_scatter


def reduce_scatter(
    tensor: Tensor,
    comm: Comm,
    op: str = "sum",
    *,
    algo: str | None = None,
    bounds: list[tuple[int, int]] | None = None,
) -> Tensor:
    """This rank's chunk (``bounds[rank]``, default chunk_bounds(numel, N)[rank]) of the elementwise
    reduction, as a new 1-D tensor. ``tensor`` is read only. algo: None (by cost), "direct",
    "ring" or "halving". Uneven ``bounds`` let ZeRO reduce a bucket straight into each rank's
    partition."""
    check_op(op, tensor.dtype)
    flat = _flat(tensor)
    custom = bounds is not None
    bounds = _check_bounds(bounds, flat.numel(), comm, "reduce_scatter")
    lo, hi = bounds[comm.rank]
    out = _empty(hi - lo, flat)
    name, _ = _pick("reduce_scatter", algo, flat, comm, RS.ALGORITHMS)
    shown = bounds if custom else None  # the header carries uneven bounds only
    with collective(
        comm, "reduce_scatter", numel=flat.numel(), dtype=flat.dtype, op=op, algo=name, bounds=shown
    ):
        return _reduce_scatter(flat, comm, op, name, out, bounds)


def _reduce_scatter(
    flat: Tensor, comm: Comm, op: str, algo: str, out: Tensor, bounds: list[tuple[int, int]]
) -> Tensor:
    """Reduce this rank's chunk into ``out``, which may be that chunk of ``flat`` itself."""
    lo, hi = bounds[comm.rank]
    if comm.size == 1:
        return out.copy_(flat[lo:hi])
    if comm.dry:
        return out
    if algo == "torch":
        run = native.reduce_scatter
    else:
        run = _execution("reduce_scatter", algo, comm, RS.ALGORITHMS)
    run(flat, comm, op, out, bounds, SEGMENT_BYTES)
    if op == "avg":
        out.div_(comm.size)  # once, on the owner, so every rank later gets the same bytes
    return out


# --------------------------------------------------------------------------- all_gather


def all_gather(
    output: Tensor,
    chunk: Tensor,
    comm: Comm,
    *,
    algo: str | None = None,
    bounds: list[tuple[int, int]] | None = None,
) -> Tensor:
    """Fill ``output`` (flat) on every rank from each rank's ``chunk``, which lands at
    ``bounds[rank]`` (default: the even split). ``chunk`` may be the view of ``output`` at this
    rank's position. algo: None (by cost), "direct", "ring" or "bruck"."""
    flat = _flat(output)
    custom = bounds is not None
    bounds = _check_bounds(bounds, flat.numel(), comm, "all_gather")
    lo, hi = bounds[comm.rank]
    if chunk.numel() != hi - lo:
        raise ValueError(
            f"all_gather: rank {comm.rank} chunk has {chunk.numel()} elements, "
            f"expected {hi - lo} of {flat.numel()}"
        )
    name, run = _pick("all_gather", algo, flat, comm, AG.ALGORITHMS)
    mine = flat[lo:hi]
    if chunk.data_ptr() != mine.data_ptr() or chunk.dtype != mine.dtype:
        mine.copy_(chunk.reshape(-1))  # (casts to output's dtype if they differ)
    if comm.size > 1:
        shown = bounds if custom else None  # the header carries uneven bounds only
        with collective(comm, "all_gather", numel=flat.numel(), dtype=flat.dtype, algo=name, bounds=shown):
            run(flat, comm, bounds, SEGMENT_BYTES)
    return output


# --------------------------------------------------------------------------- all_reduce


def _ar_exchange(flat: Tensor, comm: Comm, op: str) -> None:
    """Everyone sends the whole tensor to everyone; each rank reduces in rank order 0..N-1,
    so all ranks perform the identical sequence of operations and agree bitwise."""
    p2p, me = P2P("all_reduce", comm), comm.rank
    parts = [flat if j == me else torch.empty_like(flat) for j in range(comm.size)]
    handles = [p2p.recv(parts[j], j) for j in range(comm.size) if j != me]
    handles += [p2p.send(flat, j) for j in range(comm.size) if j != me]
    p2p.wait(*handles)  # all sends done: now `flat` may be overwritten
    fold(parts, me, op, flat)
    if op == "avg":
        flat.div_(comm.size)


def _ar_via(rs: str, ag):
    """reduce_scatter into our own chunk of the tensor, then all_gather it in place."""

    def run(flat: Tensor, comm: Comm, op: str) -> None:
        bounds = chunk_bounds(flat.numel(), comm.size)
        _reduce_scatter(flat, comm, op, rs, flat[slice(*bounds[comm.rank])], bounds)
        ag(flat, comm, bounds, SEGMENT_BYTES)

    return run


_AR = {
    "exchange": _ar_exchange,
    "direct": _ar_via("direct", AG.direct),
    "ring": _ar_via("ring", AG.ring),
    "rabenseifner": _ar_via("halving", AG.doubling),
}


def all_reduce(tensor: Tensor, comm: Comm, op: str = "sum", *, algo: str | None = None) -> Tensor:
    """In place; every rank ends with identical bytes. algo: None (by cost), "exchange", "direct",
    "ring" (reduce_scatter + all_gather with that algorithm) or "rabenseifner" (recursive-halving
    reduce_scatter + recursive-doubling all_gather)."""
    check_op(op, tensor.dtype)
    flat = _flat(tensor)
    name, run = _pick("all_reduce", algo, flat, comm, _AR)
    if comm.size > 1:
        with collective(comm, "all_reduce", numel=flat.numel(), dtype=flat.dtype, op=op, algo=name):
            run(flat, comm, op)
    return tensor


# --------------------------------------------------------------------------- broadcast


def broadcast(tensor: Tensor, src: int, comm: Comm, *, algo: str | None = None) -> Tensor:
    """In place on every rank from group rank ``src``. algo: None (by cost), "flat", "tree",
    "chain" or "scatter" (scatter + all_gather, van de Geijn)."""
    if not 0 <= src < comm.size:
        raise ValueError(f"broadcast: src {src} is not a group rank of {list(comm.ranks)}")
    flat = _flat(tensor)
    name, run = _pick("broadcast", algo, flat, comm, BC.ALGORITHMS)
    if comm.size > 1:
        extra = {}
        if name == "scatter":  # its all_gather: the one the model picks for the whole tensor
            ag = choose_algorithm("all_gather", flat.numel() * flat.element_size(), comm.size)
            extra = {"chunks": chunk_bounds(flat.numel(), comm.size), "all_gather": AG.ALGORITHMS[ag]}
        with collective(comm, "broadcast", numel=flat.numel(), dtype=flat.dtype, src=src, algo=name):
            run(flat, src, comm, SEGMENT_BYTES, **extra)
    return tensor


# --------------------------------------------------------------------------- bytes


def all_gather_bytes(payload: bytes, comm: Comm) -> list[bytes]:
    """Every rank's ``payload`` (any length), indexed by group rank, on every rank."""
    n = comm.size
    with collective(comm, "all_gather_bytes"):
        lengths = torch.zeros(n, dtype=torch.int64, device="cpu")
        all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64, device="cpu"), comm)
        width = int(lengths.max())
        buf = torch.zeros(n * width, dtype=torch.uint8, device="cpu")
        mine = buf[comm.rank * width : comm.rank * width + len(payload)]
        if payload:
            mine.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        all_gather(buf, buf[comm.rank * width : (comm.rank + 1) * width], comm)
    raw = buf.numpy().tobytes()
    return [raw[j * width : j * width + int(lengths[j])] for j in range(n)]
