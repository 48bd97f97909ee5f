"""all_gather algorithms, in place: on entry each rank's own ``bounds`` chunk of ``flat`` holds its
contribution; on return every chunk does, on every rank. Copies only: every rank ends bitwise
identical whichever algorithm ran."""

from __future__ import annotations

from torch import Tensor

from distlib.comm.algorithms.base import Virtual, segments
from distlib.comm.group import Comm
from distlib.comm.p2p import P2P

Bounds = list[tuple[int, int]]


def direct(flat: Tensor, comm: Comm, bounds: Bounds, seg: int) -> None:
    """Everyone sends its chunk to everyone, in one round, straight into `flat`."""
    p2p, me = P2P("all_gather", comm), comm.rank
    mine = flat[slice(*bounds[me])]
    handles = [p2p.recv(flat[a:b], j) for j, (a, b) in enumerate(bounds) if j != me]
    handles += [p2p.send(mine, j) for j in range(comm.size) if j != me]
    p2p.wait(*handles)


def ring(flat: Tensor, comm: Comm, bounds: Bounds, seg: int) -> None:
    """Ring: chunk (me-s) travels right at step s. All receives land in their final place in
    `flat`, so they are posted up front and each segment is forwarded as soon as it lands."""
    p2p, n, me = P2P("all_gather", comm), comm.size, comm.rank

    def segs(chunk):
        lo, hi = bounds[chunk % n]
        return [flat[lo + a : lo + b] for a, b in segments(hi - lo, flat.element_size(), seg)]

    incoming = [segs(me - s - 1) for s in range(n - 1)]  # chunk received at step s
    # Batched (NCCL: a round's messages go out together) step s's receives are posted at step s,
    # with the forwards of step s - 1; otherwise all up front.
    recvs = [[p2p.recv(t, me - 1) for t in step] for step in incoming[: 1 if comm.batched else n - 1]]
    sends = [p2p.send(t, me + 1) for t in segs(me)]
    for s in range(n - 1):
        if s >= len(recvs):
            recvs.append([p2p.recv(t, me - 1) for t in incoming[s]])
        for t, h in zip(incoming[s], recvs[s]):
            p2p.wait(h)
            if s < n - 2:  # the last chunk stops here
                sends.append(p2p.send(t, me + 1))
    p2p.wait(*sends)


def bruck(flat: Tensor, comm: Comm, bounds: Bounds, seg: int) -> None:
    """Bruck et al. (1997): after round k a rank holds the 2^k chunks me, me+1, ..; in round k it
    sends min(2^k, N - 2^k) of them to me - 2^k and gets as many from me + 2^k. ceil(log2 N)
    rounds at any N, (N-1)/N B per rank; chunks land in place, so no final rotation."""
    p2p, n, me = P2P("all_gather", comm), comm.size, comm.rank

    def runs(first: int, count: int):
        """Chunks first .. first+count-1 (mod N) as at most two contiguous views of `flat`."""
        first %= n
        spans = [(first, min(first + count, n))] + ([(0, first + count - n)] if first + count > n else [])
        return [flat[bounds[i][0] : bounds[j - 1][1]] for i, j in spans]

    have = 1
    while have < n:
        count = min(have, n - have)
        handles = [p2p.recv(t, me + have) for t in runs(me + have, count)]
        handles += [p2p.send(t, me - have) for t in runs(me, count)]
        p2p.wait(*handles)
        have += count


def doubling(flat: Tensor, comm: Comm, bounds: Bounds, seg: int) -> None:
    """Recursive doubling on virtual ranks (``base.Virtual``; the second half of Rabenseifner's
    all-reduce): at distance d = 1, 2, .. p/2 swap the ranges held with partner v ^ d. A rank
    folded into its odd neighbour hands its chunk over first and gets the whole tensor back."""
    p2p, me, vr = P2P("all_gather", comm), comm.rank, Virtual(comm, bounds)
    if vr.idle:
        p2p.wait(p2p.send(flat[slice(*bounds[me])], me + 1))
        p2p.wait(p2p.recv(flat, me + 1))
        return
    if me < 2 * vr.rem:
        p2p.wait(p2p.recv(flat[slice(*bounds[me - 1])], me - 1))
    v, d = vr.v, 1
    while d < vr.p:
        v0 = v & ~(2 * d - 1)  # our range after this round: v0 .. v0 + 2d
        mine, theirs = (v0, v0 + d), (v0 + d, v0 + 2 * d)
        if v & d:
            mine, theirs = theirs, mine
        peer = vr.real(v ^ d)
        p2p.wait(p2p.recv(flat[slice(*vr.span(*theirs))], peer), p2p.send(flat[slice(*vr.span(*mine))], peer))
        d *= 2
    if me < 2 * vr.rem:
        p2p.wait(p2p.send(flat, me - 1))


ALGORITHMS = {"direct": direct, "ring": ring, "bruck": bruck}
