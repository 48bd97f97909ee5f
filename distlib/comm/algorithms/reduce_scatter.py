"""reduce_scatter algorithms: ``out`` (this rank's ``bounds`` chunk, possibly a view of ``flat``
itself) receives the reduction of that chunk over all ranks; ``flat`` is only read, except
through ``out``. Division for avg is the caller's (once, on the owner)."""

from __future__ import annotations

from torch import Tensor

from distlib.comm.algorithms.base import Virtual, combine, empty, fold, segments
from distlib.comm.group import Comm
from distlib.comm.p2p import P2P

Bounds = list[tuple[int, int]]


def direct(flat: Tensor, comm: Comm, op: str, out: Tensor, bounds: Bounds, seg: int) -> None:
    """Send chunk j straight to rank j; the owner reduces all N parts in rank order 0..N-1."""
    p2p, n, me = P2P("reduce_scatter", comm), comm.size, comm.rank
    lo, hi = bounds[me]
    parts = [flat[lo:hi] if j == me else empty(hi - lo, flat) for j in range(n)]
    handles = [p2p.recv(parts[j], j) for j in range(n) if j != me]
    handles += [p2p.send(flat[a:b], j) for j, (a, b) in enumerate(bounds) if j != me]
    p2p.wait(*handles)
    fold(parts, me, op, out)


def ring(flat: Tensor, comm: Comm, op: str, out: Tensor, bounds: Bounds, seg: int) -> None:
    """Ring: at step s pass the partial sum of chunk (me-s-1) right and fold ours into the one
    arriving from the left; after N-1 steps chunk `me` has visited every rank. Each step is
    split in segments so reducing one segment overlaps receiving the next."""
    p2p, n, me = P2P("reduce_scatter", comm), comm.size, comm.rank
    right, left = me + 1, me - 1
    width = max(b - a for a, b in bounds)
    bufs = [empty(width, flat) for _ in range(2)]
    sending = flat[slice(*bounds[(me - 1) % n])]  # step 0 sends our own contribution
    for step in range(n - 1):
        lo, hi = bounds[(me - step - 2) % n]
        incoming = bufs[step % 2][: hi - lo]
        segs = segments(hi - lo, flat.element_size(), seg)
        recvs = [p2p.recv(incoming[a:b], left) for a, b in segs]
        sends = [
            p2p.send(sending[a:b], right) for a, b in segments(sending.numel(), flat.element_size(), seg)
        ]
        dst = out if step == n - 2 else incoming  # the last step completes our chunk
        for (a, b), h in zip(segs, recvs):
            p2p.wait(h)
            combine(incoming[a:b], flat[lo + a : lo + b], op, dst[a:b])
        p2p.wait(*sends)
        sending = incoming


def halving(flat: Tensor, comm: Comm, op: str, out: Tensor, bounds: Bounds, seg: int) -> None:
    """Recursive halving (the first half of Rabenseifner's all-reduce): at distance d = p/2, p/4,
    .. 1 (virtual ranks, see ``base.Virtual``) exchange the half of the current range the partner
    keeps and reduce the half we keep: log2 p rounds, (p-1)/p B sent per rank (+ B from each
    folded-in rank when N is not a power of two). Every partial sum is (lower ranks' . higher
    ranks'), a fixed tree -- a different order from direct's 0..N-1 fold, the same on every run."""
    p2p, me, vr = P2P("reduce_scatter", comm), comm.rank, Virtual(comm, bounds)
    if vr.idle:  # give everything to me + 1, get our chunk back
        p2p.wait(p2p.send(flat, me + 1))
        p2p.wait(p2p.recv(out, me + 1))
        return
    cur, base = flat, 0  # partial sums of elements [base, base + len)
    if me < 2 * vr.rem:  # odd: fold in the even neighbour first
        cur = empty(flat.numel(), flat)
        p2p.wait(p2p.recv(cur, me - 1))
        combine(cur, flat, op, cur)
    v, v0, v1, d = vr.v, 0, vr.p, vr.p // 2
    while d:
        keep, give, partner = (
            ((v0, v0 + d), (v0 + d, v1), v + d) if v < v0 + d else ((v0 + d, v1), (v0, v0 + d), v - d)
        )
        (ka, kb), (ga, gb) = vr.span(*keep), vr.span(*give)
        incoming = empty(kb - ka, flat)
        peer = vr.real(partner)
        p2p.wait(p2p.recv(incoming, peer), p2p.send(cur[ga - base : gb - base], peer))
        mine = cur[ka - base : kb - base]
        combine(*((mine, incoming) if v < partner else (incoming, mine)), op, incoming)
        cur, base, (v0, v1), d = incoming, ka, keep, d // 2
    if me < 2 * vr.rem:  # the even neighbour's chunk goes back
        lo, hi = bounds[me - 1]
        p2p.wait(p2p.send(cur[lo - base : hi - base], me - 1))
    lo, hi = bounds[me]
    out.copy_(cur[lo - base : hi - base])


ALGORITHMS = {"direct": direct, "ring": ring, "halving": halving}
