"""The collectives of a group with a board (``board.Board``): each member writes its part into its
own slot once, and reads what it needs from the others' slots after a barrier.

A reduction's bits depend only on the order its additions take, never on who performs them or
how the bytes travelled; so each reduction here evaluates, element by element, the same
expression as the message algorithm the committed cost model chose (``order``): rank order
0..N-1 (exchange, direct), around the ring ending at the element's owner (ring), or the
recursive-halving tree (halving, rabenseifner). Every result therefore equals the message
algorithm's bit for bit, and so gloo's path: the golden losses stay. Gathers, broadcasts and
all-to-alls only copy.

Shapes, for B bytes on N members (rounds of at most a slot; one barrier each):
- all_reduce while (N - 1) B is at most WHOLE_BYTES (and B fits a slot): every member reduces the
  whole tensor from the N slots (one barrier, N B read per member); above it, each reduces 1/N
  of each round into its own slot and all copy the results after a second barrier (DeepSpeed's
  shape: B read, B/N reduced).
- reduce_scatter: each member reduces its own chunk from the N slots.
- all_gather, broadcast, all_to_all: one write, one barrier, the reads.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from distlib.comm.algorithms.base import chunk_bounds, combine
from distlib.comm.board import Board, Stalled
from distlib.comm.group import Comm
from distlib.comm.p2p import CollectiveError, CollectiveMismatchError

Bounds = list[tuple[int, int]]
# An all_reduce of B bytes on N members is one barrier, every member reducing everything, while
# the (N - 1) B it reduces beyond its share is at most this. Measured (15 calls each, the median of
# the slowest rank, on a 2-core EPYC): at 2 members whole 0.60 / 0.77 ms against two barriers'
# 1.50 / 1.24 at 1 / 2 MB; at 4, 1.04 / 1.88 against 1.31 / 2.17 at 256 KB / 1 MB, but 3.46
# against 2.71 at 2 MB.
WHOLE_BYTES = 3 << 20


def board(comm: Comm) -> Board | None:
    """The group's board, where its collectives read from one (None: messages)."""
    return getattr(comm.transport, "board", None)


def runner(collective: str, algo: str):
    """``algo`` of ``collective`` read from the board, called as the message algorithm is."""
    if collective == "all_reduce":
        return lambda flat, comm, op: all_reduce(flat, comm, op, algo)
    if collective == "reduce_scatter":
        return lambda flat, comm, op, out, bounds, seg: reduce_scatter(flat, comm, op, out, bounds, algo)
    if collective == "all_gather":
        return lambda flat, comm, bounds, seg: all_gather(flat, comm, bounds)
    if collective == "broadcast":
        return lambda flat, src, comm, seg, **_: broadcast(flat, src, comm)
    return all_to_all  # copies only: every schedule delivers the same bytes


def meet(b: Board, s: int, name: str, comm: Comm) -> None:
    """The board's barrier; a member that never came is named as a failed message's peer is."""
    try:
        b.barrier(s)
    except Stalled as e:
        raise CollectiveError(
            f"{name}: rank {comm.rank} (global {comm.peer(comm.rank)}) failed waiting on "
            f"peer {e.peer} (global {comm.peer(e.peer)}) in group {list(comm.ranks)}: {e}",
            name,
            comm.peer(e.peer),
        ) from e


def _typed(slot: Tensor, dtype: torch.dtype, numel: int) -> Tensor:
    return slot[: numel * dtype.itemsize].view(dtype)


def _publish(b: Board, s: int, src: Tensor, comm: Comm) -> None:
    """Copy ``src`` into this member's slot of set ``s`` (counted as bytes sent)."""
    _typed(b.mine(s), src.dtype, src.numel()).copy_(src)
    _sent(comm, src.numel() * src.element_size())


def _sent(comm: Comm, nbytes: int) -> None:
    """Count bytes written to the board for the peers as this rank's bytes sent (``comm.stats``)."""
    stats = comm.stats
    if stats is not None:
        stats.bytes_sent[stats.current] += nbytes


def _rounds(numel: int, per: int) -> int:
    return max(1, math.ceil(numel / per))


# --------------------------------------------------------------------------- reduction orders


def _fold(sequence: list[int]):
    tree = sequence[0]
    for j in sequence[1:]:
        tree = (tree, j)
    return tree


def _halving(n: int):
    """Recursive halving's tree (``base.Virtual``): leaves are virtual ranks (a folded pair
    (2v, 2v + 1) below rem), combined lower + higher, the widest distance first."""
    p = 1 << (n.bit_length() - 1)
    rem = n - p

    def at(bit: int, v: int):
        if (1 << bit) >= p:
            return (2 * v, 2 * v + 1) if v < rem else v + rem
        return (at(bit + 1, v), at(bit + 1, v + (1 << bit)))

    return at(0, 0)


ORDERS = {  # algorithm -> the order its sums take
    "direct": "fold",
    "exchange": "fold",
    "ring": "ring",
    "halving": "tree",
    "rabenseifner": "tree",
}


@functools.lru_cache(maxsize=256)
def trees(algo: str, n: int) -> tuple:
    """The expression each owner's chunk is reduced with, by owner."""
    order = ORDERS[algo]
    if order == "fold":
        return (_fold(list(range(n))),) * n
    if order == "tree":
        return (_halving(n),) * n
    return tuple(_fold([(c + 1 + i) % n for i in range(n)]) for c in range(n))


def evaluate(tree, parts: list[Tensor], op: str, out: Tensor) -> None:
    """out = the expression ``tree`` over ``parts`` (leaves are member indices)."""
    if isinstance(tree, int):
        out.copy_(parts[tree])
        return
    left, right = tree
    if isinstance(left, int):
        a = parts[left]
    else:
        evaluate(left, parts, op, out)
        a = out
    if isinstance(right, int):
        b = parts[right]
    else:
        b = torch.empty_like(out)
        evaluate(right, parts, op, b)
    combine(a, b, op, out)


def _beside(parts: list[Tensor], out: Tensor) -> list[Tensor]:
    """The parts on ``out``'s device: a CUDA tensor over gloo (ranks sharing a GPU) is reduced on
    its GPU, as the message algorithms reduce it after staging, so the sums are theirs."""
    if out.device == parts[0].device:
        return parts
    return [p.to(out.device) for p in parts]


def _reduce(
    views: list[Tensor], w0: int, span: tuple[int, int], owners: Bounds, exprs: list, op: str, out, at: int
):
    """Reduce elements [lo, hi) = ``span`` of the round starting at element ``w0`` (``views``: the
    members' slots), each by its owner's expression, into ``out``, whose first element is ``at``."""
    lo, hi = span
    for c, (a, b) in enumerate(owners):
        x, y = max(a, lo), min(b, hi)
        if y > x:
            evaluate(exprs[c], _beside([v[x - w0 : y - w0] for v in views], out), op, out[x - at : y - at])


# --------------------------------------------------------------------------- reductions


def reduce_scatter(flat: Tensor, comm: Comm, op: str, out: Tensor, bounds: Bounds, algo: str) -> None:
    """This member's ``bounds`` chunk of the reduction into ``out`` (which may be that chunk of
    ``flat``), in ``algo``'s order. Each round carries a share of every member's chunk (``_post``),
    so every member reduces in every round."""
    b, me, n = board(comm), comm.rank, comm.size
    q, expr = b.slot // flat.element_size() // n, trees(algo, n)[me]
    length = bounds[me][1] - bounds[me][0]
    for k in range(_rounds(max(y - x for x, y in bounds), q)):
        s = b.begin()
        _post(b, s, flat, bounds, k, q, comm)
        meet(b, s, "reduce_scatter", comm)
        t0, t1 = k * q, min(length, (k + 1) * q)
        if t1 > t0:
            parts = [_typed(b.slots[s][j], flat.dtype, n * q)[me * q : me * q + t1 - t0] for j in range(n)]
            evaluate(expr, _beside(parts, out), op, out[t0:t1])


def _post(b: Board, s: int, flat: Tensor, pieces: Bounds, k: int, q: int, comm: Comm, skip: int = -1) -> None:
    """Round ``k``'s share of each piece of ``flat`` (its elements k q .. (k + 1) q) into part d of
    this member's slot (q elements each), so that every reader has work in every round."""
    slot = _typed(b.mine(s), flat.dtype, len(pieces) * q)
    moved = 0
    for d, (x, y) in enumerate(pieces):
        lo, hi = x + k * q, min(y, x + (k + 1) * q)
        if hi > lo and d != skip:
            slot[d * q : d * q + hi - lo].copy_(flat[lo:hi])
            moved += hi - lo
    _sent(comm, moved * flat.element_size())


def all_reduce(flat: Tensor, comm: Comm, op: str, algo: str) -> None:
    """In place, in ``algo``'s order; see the module's docstring for the two shapes."""
    b, n = board(comm), comm.size
    per, exprs = b.slot // flat.element_size(), trees(algo, n)
    owners = chunk_bounds(flat.numel(), n)
    if ORDERS[algo] != "ring":  # one expression for every owner: one evaluation per span
        owners, exprs = [(0, flat.numel())], exprs[:1]
    nbytes = flat.numel() * flat.element_size()
    whole = nbytes <= b.slot and (n - 1) * nbytes <= WHOLE_BYTES
    for k in range(_rounds(flat.numel(), per)):
        s = b.begin()
        w0, w1 = k * per, min(flat.numel(), (k + 1) * per)
        _publish(b, s, flat[w0:w1], comm)
        meet(b, s, "all_reduce", comm)
        views = [_typed(b.slots[s][j], flat.dtype, w1 - w0) for j in range(n)]
        if whole:
            _reduce(views, w0, (w0, w1), owners, exprs, op, flat, 0)
            if op == "avg":
                flat[w0:w1].div_(n)
            continue
        share = [(w0 + x, w0 + y) for x, y in chunk_bounds(w1 - w0, n)]
        lo, hi = share[comm.rank]
        # reduced into our own tensor (published already), then over our part of our slot, which
        # only we read: reducing into the slot would overwrite our part before a fold reads it
        _reduce(views, w0, (lo, hi), owners, exprs, op, flat, 0)
        if op == "avg":
            flat[lo:hi].div_(n)
        views[comm.rank][lo - w0 : hi - w0].copy_(flat[lo:hi])
        meet(b, s, "all_reduce", comm)
        for j, (x, y) in enumerate(share):
            if j != comm.rank:
                flat[x:y].copy_(views[j][x - w0 : y - w0])


# --------------------------------------------------------------------------- copies


def all_gather(flat: Tensor, comm: Comm, bounds: Bounds) -> None:
    """In place: this member's ``bounds`` chunk to every member, in rounds of a slot."""
    b, me = board(comm), comm.rank
    per = b.slot // flat.element_size()
    for k in range(_rounds(max(y - x for x, y in bounds), per)):
        s = b.begin()
        pieces = [(x + k * per, min(y, x + (k + 1) * per)) for x, y in bounds]
        lo, hi = pieces[me]
        _publish(b, s, flat[lo : max(lo, hi)], comm)
        meet(b, s, "all_gather", comm)
        for j, (x, y) in enumerate(pieces):
            if j != me and y > x:
                flat[x:y].copy_(_typed(b.slots[s][j], flat.dtype, y - x))


def broadcast(flat: Tensor, src: int, comm: Comm) -> None:
    """In place from member ``src``, in rounds of a slot."""
    b = board(comm)
    per = b.slot // flat.element_size()
    for k in range(_rounds(flat.numel(), per)):
        s = b.begin()
        w0, w1 = k * per, min(flat.numel(), (k + 1) * per)
        if comm.rank == src:
            _publish(b, s, flat[w0:w1], comm)
        meet(b, s, "broadcast", comm)
        if comm.rank != src:
            flat[w0:w1].copy_(_typed(b.slots[s][src], flat.dtype, w1 - w0))


def all_to_all(send: Tensor, recv: Tensor, comm: Comm, send_bounds: Bounds, recv_bounds: Bounds) -> None:
    """Piece j of ``send`` to member j, a share of every piece per round (``_post``). The first
    round's control block carries where each piece starts in each member's ``send``, so a member
    knows how many rounds there are and checks its pieces' sizes against ``recv_bounds``."""
    b, me, n = board(comm), comm.rank, comm.size
    q = b.slot // send.element_size() // n
    recv[slice(*recv_bounds[me])].copy_(send[slice(*send_bounds[me])])
    starts = [x for x, _ in send_bounds] + [send.numel()]
    rounds, where, k = 1, None, 0
    while k < rounds:
        s = b.begin()
        _post(b, s, send, send_bounds, k, q, comm, skip=me)
        if k == 0:
            b.counts[s][me][:] = starts
        meet(b, s, "all_to_all", comm)
        if k == 0:
            where = [b.counts[s][j][:] for j in range(n)]
            _check_pieces(where, recv_bounds, comm)
            rounds = _rounds(max(w[d + 1] - w[d] for w in where for d in range(n)), q)
        for j, (x, y) in enumerate(recv_bounds):
            t0, t1 = k * q, min(y - x, (k + 1) * q)
            if j != me and t1 > t0:
                recv[x + t0 : x + t1].copy_(
                    _typed(b.slots[s][j], send.dtype, n * q)[me * q : me * q + t1 - t0]
                )
        k += 1


def _check_pieces(where: list[list[int]], recv_bounds: Bounds, comm: Comm) -> None:
    me = comm.rank
    for j, (x, y) in enumerate(recv_bounds):
        sent = where[j][me + 1] - where[j][me]
        if sent != y - x:
            raise CollectiveMismatchError(
                f"all_to_all: group rank {j} sends {sent} elements to rank {me}, which expects {y - x}",
                "all_to_all",
                comm.peer(j),
            )
