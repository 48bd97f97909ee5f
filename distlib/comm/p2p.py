"""The point-to-point layer under every hand-written collective, and the errors they raise.

``P2P`` posts non-blocking sends and receives (``dist.isend`` / ``dist.irecv``) to members of a
``Comm``, addressed by group rank, and waits on them. Every wait is bounded by the process
group's timeout (``dist.timeout_s``); a wait or a post that fails -- a peer that timed out, or
died -- raises ``CollectiveError`` naming the collective, this rank and the peer (group and
global rank), so a stall is never a bare gloo message. Bytes sent are counted here, the one place
every message passes, into the kind of the outermost collective in progress (``comm.stats``).
"""
from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from distlib.comm.group import Comm


class CollectiveError(RuntimeError):
    """A collective that could not complete; ``peer`` is the global rank waited on (if any)."""

    def __init__(self, message: str, collective: str, peer: int | None = None):
        super().__init__(message)
        self.collective, self.peer = collective, peer


class CollectiveMismatchError(CollectiveError):
    """Ranks called different collectives, or the same one with different sizes or dtypes."""


class P2P:
    """Posts non-blocking sends/receives; on failure names the collective, this rank and the peer."""

    def __init__(self, name: str, comm: Comm):
        self.name, self.comm = name, comm

    def _fail(self, peer: int, what: str, err: Exception) -> CollectiveError:
        c = self.comm
        return CollectiveError(f"{self.name}: rank {c.rank} (global {c.peer(c.rank)}) failed {what} "
                               f"peer {peer} (global {c.peer(peer)}) in group {list(c.ranks)}: {err}",
                               self.name, c.peer(peer))

    def send(self, t: Tensor, peer: int):
        return self._post(dist.isend, "sending to", t, peer)

    def recv(self, t: Tensor, peer: int):
        return self._post(dist.irecv, "waiting on", t, peer)

    def _post(self, fn, what, t, peer):
        if t.numel() == 0:      # both sides know the sizes, so empty messages are skipped on both
            return None
        peer %= self.comm.size
        stats = self.comm.stats
        if stats is not None and fn is dist.isend:
            stats.bytes_sent[stats.current] += t.numel() * t.element_size()
        try:
            return (fn(t, self.comm.peer(peer), group=self.comm.group), peer, what)
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise self._fail(peer, what, e) from e

    def wait(self, *handles) -> None:
        for h in handles:
            if h is None:
                continue
            work, peer, what = h
            try:
                work.wait()
            except Exception as e:  # noqa: BLE001 - a timeout or a dead peer
                raise self._fail(peer, what, e) from e
