"""Moving snapshot bytes between ranks: the peer replica of each snapshot, and the transfers of a
restore (a rank whose own snapshot is gone gets it from the rank that holds its replica). They
are host bytes, so their tensors are on the CPU whatever the model's device (over NCCL
``p2p.P2P`` stages them).

Peers: with L ranks per node (``LOCAL_WORLD_SIZE``) and W ranks in all, rank r's snapshot is also
held by rank (r + L) mod W -- a rank of the next node, in torchrun's rank order (node k holds
global ranks k*L .. k*L+L-1) -- so losing one node's memory loses no snapshot. On one node
(L = W) there is no peer and nothing is sent.
"""

from __future__ import annotations

import numpy as np
import torch

from distlib.comm.group import Comm
from distlib.comm.p2p import P2P


def peer_offset(local_world_size: int, world_size: int) -> int:
    """How far (in ranks) a snapshot's replica lives from its owner; 0: no replica (one node)."""
    if local_world_size <= 0 or local_world_size >= world_size:
        return 0
    return local_world_size


def _as_tensor(data: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.zeros(0, dtype=torch.uint8, device="cpu")
    )


def _joined(pieces: list) -> torch.Tensor:
    """The bytes of ``pieces`` (bytes-like, in order) in one tensor: one buffer, one copy of each."""
    sizes = [memoryview(p).nbytes for p in pieces]
    out = torch.empty(sum(sizes), dtype=torch.uint8, device="cpu")
    flat, start = out.numpy(), 0
    for piece, size in zip(pieces, sizes):
        flat[start : start + size] = np.frombuffer(piece, dtype=np.uint8)  # (bytes stay read-only)
        start += size
    return out


def exchange(pieces: list, digest: str, comm: Comm, offset: int) -> tuple:
    """Send the bytes of ``pieces`` (bytes-like, in order: ``memory_snapshot.pieces``) and their
    sha256 ``digest`` (hex) to rank (r + offset); receive rank (r - offset)'s: returns (its bytes,
    a NumPy uint8 array, bytes-like; its digest). The digest is the owner's, taken before the
    bytes left it: a replica changed on its way is refused when it is read, where a digest of what
    arrived would vouch for it. No buffer is made but the one sent and the one received."""
    p2p = P2P("snapshot replica", comm)
    to, frm = (comm.rank + offset) % comm.size, (comm.rank - offset) % comm.size
    outgoing = _joined(pieces)
    # (the size, 8 bytes little-endian, then the digest's 32)
    header = outgoing.numel().to_bytes(8, "little") + bytes.fromhex(digest)
    heads = (torch.tensor(list(header), dtype=torch.uint8), torch.empty(40, dtype=torch.uint8))
    p2p.wait(p2p.send(heads[0], to), p2p.recv(heads[1], frm))
    theirs = heads[1].numpy().tobytes()
    incoming = torch.empty(int.from_bytes(theirs[:8], "little"), dtype=torch.uint8, device="cpu")
    p2p.wait(p2p.send(outgoing, to), p2p.recv(incoming, frm))
    return incoming.numpy(), theirs[8:].hex()


def deliver(sends: list[tuple[int, bytes]], receive: tuple[int, int] | None, comm: Comm) -> bytes | None:
    """One round of transfers every rank agreed on: this rank sends each (to_rank, bytes) of
    ``sends`` and, with ``receive`` = (from_rank, size), receives that many bytes (returned)."""
    p2p = P2P("snapshot restore", comm)
    handles = [p2p.send(_as_tensor(data), to) for to, data in sends]
    incoming = None
    if receive is not None:
        incoming = torch.zeros(receive[1], dtype=torch.uint8, device="cpu")
        handles.append(p2p.recv(incoming, receive[0]))
    p2p.wait(*handles)
    return None if incoming is None else incoming.numpy().tobytes()
