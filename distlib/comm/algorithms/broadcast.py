"""broadcast algorithms, in place from group rank ``src``. Copies only: every rank ends with the
root's bytes whichever algorithm ran. ``chunks`` is chunk_bounds(numel, N), which scatter uses."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from distlib.comm.algorithms.base import segments
from distlib.comm.group import Comm
from distlib.comm.p2p import P2P


def flat(t: Tensor, src: int, comm: Comm, seg: int, **_) -> None:
    """The root sends the whole tensor to every rank at once: one level of waiting, (N-1) B from
    the root -- for small tensors, where a wake-up costs more than the bytes."""
    p2p = P2P("broadcast", comm)
    if comm.rank == src:
        p2p.wait(*[p2p.send(t, j) for j in range(comm.size) if j != src])
    else:
        p2p.wait(p2p.recv(t, src))


def tree(t: Tensor, src: int, comm: Comm, seg: int, **_) -> None:
    """Binomial tree: relative rank v gets the data from v minus its highest bit, then passes
    it to v + 2^k for every 2^k > v; log2 N levels, sends never waited on one by one."""
    p2p, n = P2P("broadcast", comm), comm.size
    v = (comm.rank - src) % n  # position relative to the root
    if v:
        p2p.wait(p2p.recv(t, src + v - (1 << (v.bit_length() - 1))))
    kids = [v + (1 << k) for k in range(v.bit_length(), n.bit_length()) if v + (1 << k) < n]
    p2p.wait(*[p2p.send(t, src + kid) for kid in reversed(kids)])  # biggest subtree first


def chain(t: Tensor, src: int, comm: Comm, seg: int, **_) -> None:
    """Pipelined chain root -> root+1 -> ...: each segment is forwarded as soon as it lands,
    so the time is ~(segments + N - 2) segment transfers instead of log2 N full ones."""
    p2p, n = P2P("broadcast", comm), comm.size
    v = (comm.rank - src) % n
    segs = [t[a:b] for a, b in segments(t.numel(), t.element_size(), seg)]
    recvs = [p2p.recv(s, comm.rank - 1) if v else None for s in segs]
    sends = []
    for s, h in zip(segs, recvs):
        p2p.wait(h)
        if v < n - 1:  # the last rank of the chain only receives
            sends.append(p2p.send(s, comm.rank + 1))
    p2p.wait(*sends)


def scatter(
    t: Tensor, src: int, comm: Comm, seg: int, *, chunks: list[tuple[int, int]], all_gather: Callable
) -> None:
    """van de Geijn: the root scatters chunk j to rank j, then an all_gather (the one the cost
    model picks for the size) completes every copy: the root sends (N-1)/N B instead of B per
    level, each rank 2 (N-1)/N B in all."""
    p2p, me = P2P("broadcast", comm), comm.rank
    if me == src:
        p2p.wait(*[p2p.send(t[a:b], j) for j, (a, b) in enumerate(chunks) if j != src])
    else:
        p2p.wait(p2p.recv(t[slice(*chunks[me])], src))
    all_gather(t, comm, chunks, seg)


ALGORITHMS = {"flat": flat, "tree": tree, "chain": chain, "scatter": scatter}
