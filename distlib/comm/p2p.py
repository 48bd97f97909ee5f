"""The point-to-point layer under every hand-written collective, and the errors they raise.

``P2P`` posts non-blocking sends and receives (``dist.isend`` / ``dist.irecv``) to members of a
``Comm``, addressed by group rank, and waits on them. Every wait is bounded by the process
group's timeout (``dist.timeout_s``); a wait or a post that fails -- a peer that timed out, or
died -- raises ``CollectiveError`` naming the collective, this rank and the peer (group and
global rank), so a stall is never a bare gloo message. Bytes sent are counted here, the one place
every message passes, into the kind of the outermost collective in progress (``comm.stats``).
"""

from __future__ import annotations

import contextvars

import torch
import torch.distributed as dist
from torch import Tensor

from distlib.comm import tally
from distlib.comm.group import Comm


class CollectiveError(RuntimeError):
    """A collective that could not complete; ``peer`` is the global rank waited on (if any)."""

    def __init__(self, message: str, collective: str, peer: int | None = None):
        super().__init__(message)
        self.collective, self.peer = collective, peer


class CollectiveMismatchError(CollectiveError):
    """Ranks called different collectives, or the same one with different sizes or dtypes.
    ``agreed``: every rank of the group raised this same error (the header check compared every
    member's call); otherwise only this rank saw it (a message of the wrong size), and it alone
    can say why."""

    def __init__(self, message: str, collective: str, peer: int | None = None, *, agreed: bool = False):
        super().__init__(message, collective, peer)
        self.agreed = agreed


# The header gate of the checked outermost collective in progress (``header.Gate``), if any: it
# sees every message posted before the header check passes (``header`` explains why).
GATE: contextvars.ContextVar = contextvars.ContextVar("collective_header_gate", default=None)


class Done:
    """The work of a message that needs no wait (a receive served from the header message)."""

    def wait(self) -> None:
        pass


class Message:
    """One posted (or, batched, about to be posted) send or receive. ``wire`` is the tensor that
    travels (``tensor`` itself, or its staging buffer on the transport device); a staged receive
    is copied back into ``tensor`` after its wait."""

    def __init__(self, fn, tensor: Tensor, wire: Tensor, peer: int, what: str):
        self.fn, self.tensor, self.wire, self.peer, self.what = fn, tensor, wire, peer, what
        self.work = None


class P2P:
    """Posts non-blocking sends/receives; on failure names the collective, this rank and the peer.

    Where a tensor lives and where the group's messages travel (``comm.device``) may differ: a
    CUDA tensor over gloo is staged through pinned host memory (measured: a gloo isend of a CUDA
    tensor aborts the process) and a host tensor over NCCL through a device buffer. With
    ``comm.batched`` (NCCL) messages are not posted one by one: the ones posted since the last
    flush go out together, in one ``dist.batch_isend_irecv``, at the first wait on one of them."""

    def __init__(self, name: str, comm: Comm):
        self.name, self.comm = name, comm
        self._pending: list[Message] = []

    def _fail(self, peer: int, what: str, err: Exception) -> CollectiveError:
        c = self.comm
        return CollectiveError(
            f"{self.name}: rank {c.rank} (global {c.peer(c.rank)}) failed {what} "
            f"peer {peer} (global {c.peer(peer)}) in group {list(c.ranks)}: {err}",
            self.name,
            c.peer(peer),
        )

    def send(self, t: Tensor, peer: int):
        return self._post(dist.isend, "sending to", t, peer)

    def recv(self, t: Tensor, peer: int):
        return self._post(dist.irecv, "waiting on", t, peer)

    def staged(self, t: Tensor) -> bool:
        """Whether ``t`` lives on another kind of device than the one the messages travel on."""
        return t.device.type != torch.device(self.comm.device).type

    def _wire(self, t: Tensor) -> Tensor:
        if self.comm.device == "cpu":  # pinned: the copies are DMA, and do not go through pageable memory
            return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        return torch.empty(t.shape, dtype=t.dtype, device=self.comm.device)

    def _post(self, fn, what, t, peer):
        if t.numel() == 0 or self.comm.dry:  # both sides know the sizes: empty messages are skipped
            if fn is dist.isend and t.numel():
                tally.note(self.comm, "send", t.numel() * t.element_size())
            return None  # (a dry group, the planner's, sends nothing)
        peer %= self.comm.size
        stats = self.comm.stats
        if stats is not None and fn is dist.isend:
            stats.bytes_sent[stats.current] += t.numel() * t.element_size()
        wire = t
        if self.staged(t):
            wire = self._wire(t)
            if fn is dist.isend:
                wire.copy_(t)  # synchronous: the bytes are in the buffer before it is posted
        message = Message(fn, t, wire, peer, what)
        gate = GATE.get()
        if gate is not None and gate.comm is self.comm:
            gate.post(self, message)  # the header rides in it, or it waits for the check
            return message
        if self.comm.batched:
            self._pending.append(message)
            return message
        return self.start(message)

    def start(self, message: Message) -> Message:
        """Post ``message`` now: to the group's shared-memory transport where it has one, else to gloo."""
        transport = self.comm.transport
        try:
            if transport is None:
                message.work = message.fn(message.wire, self.comm.peer(message.peer), group=self.comm.group)
            elif message.fn is dist.isend:
                message.work = transport.send(message.wire, message.peer % self.comm.size)
            else:
                message.work = transport.recv(message.wire, message.peer % self.comm.size)
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise self._fail(message.peer, message.what, e) from e
        return message

    def _flush(self) -> None:
        """Post every pending message as one batch (NCCL: one grouped launch)."""
        pending, self._pending = self._pending, []
        ops = [dist.P2POp(m.fn, m.wire, self.comm.peer(m.peer), self.comm.group) for m in pending]
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise self._fail(pending[0].peer, pending[0].what, e) from e
        for m, work in zip(pending, works):
            m.work = work

    def wait(self, *handles) -> None:
        gate = GATE.get()
        if gate is not None and gate.comm is self.comm:
            gate.settle()  # every header first: a mismatch raises before any payload
        messages = [h for h in handles if h is not None]
        if any(m.work is None for m in messages):
            self._flush()
        for m in messages:
            try:
                m.work.wait()
            except Exception as e:  # noqa: BLE001 - a timeout or a dead peer
                raise self._fail(m.peer, m.what, e) from e
            if m.fn is dist.irecv and m.wire is not m.tensor:
                m.tensor.copy_(m.wire)
