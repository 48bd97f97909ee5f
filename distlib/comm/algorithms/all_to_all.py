"""all_to_all algorithms: piece j of rank i's ``send`` lands as piece i of rank j's ``recv``.

``send_bounds[j]`` is the (start, end) of the piece for rank j in ``send``, ``recv_bounds[i]``
where rank i's piece lands in ``recv`` (both flat, uneven, possibly empty; the caller made the
sizes agree by exchanging the counts first). Copies only, so every algorithm delivers the same
bytes as any other, and as torch's ``all_to_all_single``; they differ in how the N - 1
messages each rank sends are scheduled.
"""

from __future__ import annotations

from torch import Tensor

from distlib.comm.group import Comm
from distlib.comm.p2p import P2P

Bounds = list[tuple[int, int]]


def _own_piece(send: Tensor, recv: Tensor, me: int, send_bounds: Bounds, recv_bounds: Bounds) -> None:
    recv[slice(*recv_bounds[me])].copy_(send[slice(*send_bounds[me])])


def direct(send: Tensor, recv: Tensor, comm: Comm, send_bounds: Bounds, recv_bounds: Bounds) -> None:
    """Every message posted at once, one wait: one round, N - 1 messages in flight per rank."""
    p2p, me = P2P("all_to_all", comm), comm.rank
    handles = [p2p.recv(recv[a:b], j) for j, (a, b) in enumerate(recv_bounds) if j != me and b > a] + [
        p2p.send(send[a:b], j) for j, (a, b) in enumerate(send_bounds) if j != me and b > a
    ]
    _own_piece(send, recv, me, send_bounds, recv_bounds)
    p2p.wait(*handles)


def pairwise(send: Tensor, recv: Tensor, comm: Comm, send_bounds: Bounds, recv_bounds: Bounds) -> None:
    """N - 1 rounds; in round k a rank sends to me + k and receives from me - k, so each rank has
    one message in each direction in flight (MPI's pairwise exchange: no rank is flooded when
    all send to the same peer at once)."""
    p2p, n, me = P2P("all_to_all", comm), comm.size, comm.rank
    _own_piece(send, recv, me, send_bounds, recv_bounds)
    for k in range(1, n):
        to, frm = (me + k) % n, (me - k) % n
        (a, b), (c, d) = send_bounds[to], recv_bounds[frm]
        handles = ([p2p.recv(recv[c:d], frm)] if d > c else []) + ([p2p.send(send[a:b], to)] if b > a else [])
        p2p.wait(*handles)


ALGORITHMS = {"direct": direct, "pairwise": pairwise}
