"""A board every member of a shared-memory group can read: one slot per member, and a barrier.

The rings of ``shm.Transport`` copy a message twice (into the ring, out of it) and hand it over
in pieces when the ring fills. Where every member can read every other's memory, a collective
needs neither: each member writes its contribution once into its own slot, all meet at a
barrier, and each reads straight from the slots what it needs (its chunk of every member's part
to reduce, or every member's chunk to gather). That is DeepSpeed's shape for a CPU all-reduce
on one host (its PR #5391); the collectives built on it are in ``algorithms.reads``.

Layout, after the rings: a line per member holding how many barriers it has reached, then two
sets of slots; each slot is a control block (a header of the call, counts) and ``slot`` bytes of
data. A message longer than a slot goes in rounds of at most ``slot`` bytes. Rounds alternate
between the two sets, which makes one barrier per round enough: a member writes set s again
only after passing the next round's barrier, which every member reaches after it finished
reading set s.

Waiting is the transport's: sleep on this member's doorbell (every member bumps every other's
when it arrives), at most ``PROBE_S`` at a time, checking that the members not arrived yet are
alive, and never longer than ``timeout_s`` in all.
"""

from __future__ import annotations

import ctypes
import time

from torch import Tensor

from distlib.comm import shm

_LINE = 64
HEADER_WORDS = 8  # a checked call's header (``header.collective``)
# Bytes of slots per group (both sets): 2 MiB a slot at 4 members, 1 MiB at 8, never under 64 KiB,
# never over 4 MiB (a round's barrier costs ~50-100 us here; a 4 MiB round copies in ~0.5 ms).
BUDGET, MIN_SLOT, MAX_SLOT = 16 << 20, 64 << 10, 4 << 20


def slot_for(n: int) -> int:
    """The slot size of a group of ``n`` members (a multiple of the cache line)."""
    return max(MIN_SLOT, min(MAX_SLOT, BUDGET // (2 * max(1, n)))) // _LINE * _LINE


def control_bytes(n: int) -> int:
    """A slot's control block: the header, a count per member, a total (8-byte words)."""
    return ((HEADER_WORDS + n + 1) * 8 + _LINE - 1) // _LINE * _LINE


def board_bytes(n: int, slot: int) -> int:
    return n * _LINE + 2 * n * (control_bytes(n) + slot) if slot else 0


class Stalled(RuntimeError):
    """A barrier that did not complete: ``peer`` is the member it waited on."""

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


class Board:
    """The slots and the barrier of a group's members (``shm.Transport.board``)."""

    def __init__(self, transport: shm.Transport, flat: Tensor, offset: int, slot: int):
        n, mm = transport.n, transport.mm
        self.transport, self.n, self.me, self.slot = transport, n, transport.me, slot
        self.arrived = [ctypes.c_uint64.from_buffer(mm, offset + r * _LINE) for r in range(n)]
        ctl, base = control_bytes(n), offset + n * _LINE
        places = [[base + (s * n + r) * (ctl + slot) for r in range(n)] for s in range(2)]
        # the control words as ctypes arrays: a header written and read as a list costs ~1 us,
        # through a tensor ~20 us (torch.tensor, .tolist), which a small collective would feel
        words = ctypes.c_int64 * HEADER_WORDS
        self.headers = [[words.from_buffer(mm, p) for p in row] for row in places]
        tail = ctypes.c_int64 * (n + 1)
        self.counts = [[tail.from_buffer(mm, p + ctl - 8 * (n + 1)) for p in row] for row in places]
        self.slots = [[flat[p + ctl : p + ctl + slot] for p in row] for row in places]
        self.barriers = 0  # barriers this member passed (the same count on every member)
        self.rounds = 0  # rounds begun: the set in use is rounds % 2
        self.expected = None  # (header words, check) of the checked call waiting for its barrier

    # ---------------------------------------------------------------- rounds

    def begin(self) -> int:
        """Start a round: the set its writes and reads use."""
        self.rounds += 1
        return self.rounds % 2

    def mine(self, s: int) -> Tensor:
        return self.slots[s][self.me]

    def expect(self, header: list[int], check) -> None:
        """Publish ``header`` at the next barrier and call ``check`` with every member's, after it."""
        self.expected = (header, check)

    # ---------------------------------------------------------------- the barrier

    def barrier(self, s: int) -> None:
        """Wait until every member reached this barrier; set ``s`` carries the pending header."""
        expected, self.expected = self.expected, None
        if expected is not None:
            self.headers[s][self.me][:] = expected[0]
        self.barriers += 1
        count, t = self.barriers, self.transport
        self.arrived[self.me].value = count
        for j in range(self.n):
            if j != self.me:
                t.wake(j)
        self._wait(count)
        if expected is not None:
            expected[1]([self.headers[s][j][:] for j in range(self.n)])

    def _wait(self, count: int) -> None:
        t, bell = self.transport, self.transport.bells[self.me]
        began = time.monotonic()
        while True:
            seen = t.moved()  # a message still streaming to a peer may be what that peer waits for
            late = [j for j in range(self.n) if self.arrived[j].value < count]
            if not late:
                return
            waited = time.monotonic() - began
            if waited > t.timeout_s:
                raise Stalled(f"no barrier for {t.timeout_s:g} s (shared-memory transport)", late[0])
            dead = [j for j in late if waited > shm.PROBE_S and shm.exited(t.pids[j].value)]
            if dead:
                raise Stalled(shm.gone(t.pids[dead[0]].value), dead[0])
            nap = min(shm.PROBE_S, t.timeout_s - waited)
            shm.sleep_on(bell, seen, nap)
