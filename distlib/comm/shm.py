"""A point-to-point transport through shared memory, for the members of a group that share a host.

gloo carries every message between two processes on one host through a TCP pair over loopback:
a send and its receive cost two system calls, a wake-up of gloo's own thread on each side and a
copy through the kernel (measured here: a 4-rank all_reduce of 64 floats, 0.75-0.9 ms of CPU per
rank). ``Transport`` gives the same non-blocking ``send``/``recv`` (``P2P`` posts through it
instead of gloo when the group has one) over a segment of host memory the members map: one ring
per ordered pair of members, written only by the sender and read only by the receiver, so no
atomic instruction is needed, only the store order of x86-64 (a ring's bytes are stored before the
count that publishes them; other architectures are refused).

Messages keep gloo's semantics, which the algorithms and the header check rely on: each pair is
FIFO (the n-th receive from a peer gets the n-th message it sent here), a message may be shorter
than the receive posted for it (the header check's fixed-capacity receives), and a send completes
without its receive (it is copied into the ring as room allows, and the rest goes at the next
wait). A message longer than its receive raises here, where gloo aborts the process.

Waiting does not spin: four ranks on two cores would starve each other. A rank waits in the
kernel (futex) on its doorbell, a word every peer bumps after it writes to or reads from a ring
this rank shares; each wait is bounded by ``timeout_s`` and checks, every ``PROBE_S``, that the
peer it waits on is alive, so a dead peer is named in well under a second (gloo: a closed
socket), not after the timeout.

A group gets its segment from ``local.attach``, which also says why nothing is left behind.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading
import time
import weakref
from collections import deque

import torch
from torch import Tensor

_LINE = 64  # one cache line per counter: the sender's and receiver's words never share one
_SYS_FUTEX = 202  # x86-64's futex system call
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
# How often a waiting rank checks that its peer is alive (a read of /proc/<pid>/stat, ~20 us, only in
# waits longer than this). At 0.1 s the survivors of a SIGKILLed rank noticed ~0.13 s after the kill,
# a third of the own agent's kill-to-next-step (0.41 s median, benchmarks/chaos.py); at 0.02 s that
# median was 0.27-0.38 s over 7 runs of 20 kills.
PROBE_S = 0.02
LEFT = -1  # a member's pid word once it has left the segment for good: its peers' waits read it as exited

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> bool:
    """Whether this host can run the transport: Linux on x86-64 (the futex call, the store order)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def _futex(addr: int, op: int, value: int, timeout: _Timespec | None) -> None:
    # ctypes releases the GIL for the call: a rank's other threads (a communication thread) run on
    ref = ctypes.byref(timeout) if timeout is not None else None
    _libc.syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(addr),
        ctypes.c_int(op),
        ctypes.c_uint32(value),
        ref,
        None,
        0,
    )


def sleep_on(word, seen: int, seconds: float) -> None:
    """Sleep until ``word`` (a c_uint32 in the segment) no longer holds ``seen``, a wake-up, or
    ``seconds`` pass."""
    _futex(ctypes.addressof(word), _FUTEX_WAIT, seen, _Timespec(0, int(seconds * 1e9)))


def exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (dead, not yet reaped by its launcher); a
    member's pid word that says it ``LEFT`` reads as gone too."""
    if pid == LEFT:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


def gone(pid: int) -> str:
    """What a wait on a member that ``exited`` says."""
    return (
        "peer left the group (a peer of its own was lost)"
        if pid == LEFT
        else f"peer process {pid} has exited"
    )


# every segment this process has mapped and not yet dropped (``leave_all``)
_OPEN: weakref.WeakSet = weakref.WeakSet()


def leave_all() -> None:
    """Leave every segment this process has mapped: a rank that abandons its process groups (the
    survivors of a lost rank re-form theirs, distlib/launch/generations.py) wakes the peers waiting
    on it, which then fail as they would on a dead peer (within ``PROBE_S``), not after the timeout."""
    for transport in list(_OPEN):
        transport.leave()


def layout_bytes(n: int, capacity: int) -> int:
    """Size of a segment for ``n`` members: a control line each, then n (n - 1) rings."""
    return n * _LINE + n * (n - 1) * (2 * _LINE + capacity)


class _Ring:
    """The ring from one member to another: ``head`` bytes ever written (the sender's word),
    ``tail`` bytes ever read (the receiver's), ``data`` its bytes."""

    def __init__(self, mm: mmap.mmap, flat: Tensor, offset: int, capacity: int):
        self.head = ctypes.c_uint64.from_buffer(mm, offset)
        self.tail = ctypes.c_uint64.from_buffer(mm, offset + _LINE)
        self.data = flat[offset + 2 * _LINE : offset + 2 * _LINE + capacity]
        self.base, self.capacity, self.mm = offset + 2 * _LINE, capacity, mm

    def put(self, position: int, src: Tensor) -> None:
        at = position % self.capacity
        first = min(src.numel(), self.capacity - at)
        self.data[at : at + first].copy_(src[:first])
        if first < src.numel():
            self.data[: src.numel() - first].copy_(src[first:])

    def get(self, position: int, dst: Tensor) -> None:
        at = position % self.capacity
        first = min(dst.numel(), self.capacity - at)
        dst[:first].copy_(self.data[at : at + first])
        if first < dst.numel():
            dst[first:].copy_(self.data[: dst.numel() - first])

    def length_word(self, position: int):
        """The 8-byte length that opens a message (streams stay 8-aligned: it never wraps)."""
        return ctypes.c_int64.from_buffer(self.mm, self.base + position % self.capacity)


class _Op:
    """One posted message: ``buf`` its bytes (a receive: its capacity), ``pos`` how far along its
    stream (8-byte length, payload, padding to 8) it is."""

    __slots__ = ("buf", "peer", "pos", "total", "length", "done")

    def __init__(self, buf: Tensor, peer: int, length: int):
        self.buf, self.peer, self.pos, self.done = buf, peer, 0, False
        self.length = length
        self.total = 8 + _pad(length) if length >= 0 else -1  # a receive learns its length


def _pad(n: int) -> int:
    return (n + 7) & ~7


def _advance(op: _Op, word, step: int) -> int:
    """Move ``op`` and our own count ``word`` (a ring's head as sender, its tail as receiver) on by
    ``step`` stream bytes, after they were copied: that publishes them, or frees their room."""
    word.value += step
    op.pos += step
    op.done = op.pos == op.total
    return step


def _stream(op: _Op, word, available: int, copy) -> bool:
    """Move what ``available`` stream bytes allow of ``op``'s payload (and padding) through the
    ring at ``word``'s position (``copy``: the ring's put or get); whether any moved."""
    step = min(available, op.total - op.pos)
    if step <= 0:
        return False
    a, b = op.pos - 8, min(op.pos - 8 + step, op.length)
    if b > a:
        copy(word.value, op.buf[a:b])
    _advance(op, word, step)
    return True


class Work:
    """What ``send``/``recv`` return: ``wait()`` until the message is through (gloo's Work)."""

    def __init__(self, transport: Transport, op: _Op):
        self.transport, self.op = transport, op

    def wait(self) -> None:
        self.transport.wait(self.op)


class Transport:
    """Point-to-point messages among the ``n`` members of a segment (``attach`` maps it); ``me`` is
    this process's member index, ``pids`` every member's process."""

    def __init__(self, mm: mmap.mmap, n: int, me: int, capacity: int, timeout_s: float):
        self.mm, self.n, self.me, self.timeout_s = mm, n, me, timeout_s
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        self.bells = [ctypes.c_uint32.from_buffer(mm, r * _LINE) for r in range(n)]
        self.pids = [ctypes.c_int64.from_buffer(mm, r * _LINE + 8) for r in range(n)]
        self.pids[me].value = os.getpid()

        def ring(src: int, dst: int) -> _Ring:
            index = src * (n - 1) + (dst if dst < src else dst - 1)
            return _Ring(mm, flat, n * _LINE + index * (2 * _LINE + capacity), capacity)

        self.out = {j: ring(me, j) for j in range(n) if j != me}
        self.into = {j: ring(j, me) for j in range(n) if j != me}
        self.sends: dict[int, deque] = {j: deque() for j in self.out}
        self.recvs: dict[int, deque] = {j: deque() for j in self.into}
        self.lock = threading.Lock()
        self.board = None  # the members' slots (``board.Board``), where the segment has them
        _OPEN.add(self)

    # ---------------------------------------------------------------- posting

    def send(self, t: Tensor, peer: int) -> Work:
        op = _Op(_as_bytes(t), peer, t.numel() * t.element_size())
        with self.lock:
            self.sends[peer].append(op)
            if self._push(peer):
                self._ring(peer)
        return Work(self, op)

    def recv(self, t: Tensor, peer: int) -> Work:
        op = _Op(_as_bytes(t), peer, -1)
        with self.lock:
            self.recvs[peer].append(op)
        return Work(self, op)

    # ---------------------------------------------------------------- progress

    def _push(self, j: int) -> bool:
        """Copy what fits of the messages waiting for peer ``j`` into its ring; whether any did."""
        ring, queue, moved = self.out[j], self.sends[j], False
        while queue:
            op = queue[0]
            room = ring.capacity - (ring.head.value - ring.tail.value)
            if op.pos == 0:
                if room < 8:
                    break
                ring.length_word(ring.head.value).value = op.length
                room -= _advance(op, ring.head, 8)
                moved = True
            moved |= _stream(op, ring.head, room, ring.put)
            if not op.done:
                break
            queue.popleft()
        return moved

    def _pull(self, j: int) -> bool:
        """Copy what arrived from peer ``j`` into the receives posted for it; whether any did."""
        ring, queue, moved = self.into[j], self.recvs[j], False
        while queue:
            op = queue[0]
            ready = ring.head.value - ring.tail.value
            if op.pos == 0:
                if ready < 8:
                    break
                op.length = ring.length_word(ring.tail.value).value
                if op.length > op.buf.numel():
                    raise RuntimeError(
                        f"a message of {op.length} bytes arrived for a receive of {op.buf.numel()}"
                    )
                op.total = 8 + _pad(op.length)
                ready -= _advance(op, ring.tail, 8)
                moved = True
            moved |= _stream(op, ring.tail, ready, ring.get)
            if not op.done:
                break
            queue.popleft()
        return moved

    def _progress(self) -> bool:
        moved = False
        for j in self.out:
            if self.sends[j] and self._push(j):
                self._ring(j)
                moved = True
            if self.recvs[j] and self._pull(j):
                self._ring(j)
                moved = True
        return moved

    def moved(self) -> int:
        """Move what can move of the messages in flight (a wait elsewhere keeps them going); the
        doorbell's value before, for ``sleep_on``."""
        with self.lock:
            seen = self.bells[self.me].value
            self._progress()
        return seen

    def wake(self, j: int) -> None:
        """Wake member ``j`` (it re-checks whatever it waits on)."""
        self._ring(j)

    def _ring(self, j: int) -> None:
        """Bump peer ``j``'s doorbell and wake it if it sleeps on it."""
        bell = self.bells[j]
        bell.value = (bell.value + 1) & 0xFFFFFFFF
        _futex(ctypes.addressof(bell), _FUTEX_WAKE, 0x7FFFFFFF, None)

    def leave(self) -> None:
        """Tell the peers this member is gone for good (its pid word reads as an exited process)
        and wake them, so that none waits out ``timeout_s`` on a live rank that left."""
        self.pids[self.me].value = LEFT
        for j in self.out:
            self._ring(j)

    # ---------------------------------------------------------------- waiting

    def wait(self, op: _Op) -> None:
        """Move messages until ``op`` is through; sleep on our doorbell while nothing moves."""
        bell = self.bells[self.me]
        began = time.monotonic()
        while True:
            with self.lock:
                seen = bell.value
                self._progress()
                if op.done:
                    return
            waited = time.monotonic() - began
            if waited > self.timeout_s:
                raise TimeoutError(f"no message for {self.timeout_s:g} s (shared-memory transport)")
            if waited > PROBE_S and exited(self.pids[op.peer].value):
                raise RuntimeError(gone(self.pids[op.peer].value))
            nap = min(PROBE_S, self.timeout_s - waited)
            sleep_on(bell, seen, nap)

    def pending(self) -> int:
        """Messages posted and not yet through (every one is by the end of a collective)."""
        return sum(len(q) for q in self.sends.values()) + sum(len(q) for q in self.recvs.values())


def _as_bytes(t: Tensor) -> Tensor:
    return t.reshape(-1).view(torch.uint8)
