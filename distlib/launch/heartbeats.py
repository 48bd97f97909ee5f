"""The agents of a job over several hosts watching each other through the job's store (hosts.py).

Every agent adds to its ``alive/<k>`` counter every ``BEAT_S`` (``Watch.beat``); the agent serving
the store (node 0's, or its successor's: succession.py) takes a host whose counter has not moved for
``LOST_S``, and whose workers have not all finished (``done/<k>``), for lost, marks it ``lost/<k>``
and starts that host's ranks itself (agent.py). The mark fences the host should it only have been
cut off: its agent stops its workers when it reads the mark (``Fenced``), and its workers enter no
later generation (``generations.next_generation``). A host whose workers all finished says so
(``finished``), and the serving host keeps the store until every host has, or was lost.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from distlib.launch.hosts import HostError, Hosts

# An agent's heartbeat, and how long the serving host waits without one before it takes the host
# for lost: an agent loops every 10 ms, so 2 s of silence is a host (or its agent) gone, not a slow
# one; the survivors wait up to generations.WAIT_S (10 s) for the generation that replaces it.
BEAT_S, LOST_S = 0.1, 2.0
POLL_S = 0.01


def done_key(rank: int) -> str:
    return f"distlib/done/{rank}"


def lost_key(rank: int) -> str:
    return f"distlib/lost/{rank}"


def finished(store: dist.Store, place: Hosts, timeout_s: float, ended, serving: bool) -> None:
    """This host's workers all finished: say so; the host ``serving`` the store (node 0, or its
    successor) then waits until every host has said so or was lost (or the job ended elsewhere, or
    ``timeout_s``) before it leaves."""
    try:
        store.set(done_key(place.rank), "1")
        others = [k for k in range(place.count) if k != place.rank]
        deadline = time.monotonic() + timeout_s
        while serving and ended() is None and time.monotonic() < deadline:
            if all(store.check([done_key(k)]) or store.check([lost_key(k)]) for k in others):
                return
            time.sleep(POLL_S)
    except (RuntimeError, OSError):  # node 0's store is gone: nobody is left to tell
        pass


class Fenced(HostError):
    """The host serving the store took this one for lost: its ranks run elsewhere now."""


class Watch:
    """The agents' heartbeats of a several-host job (nothing on one host): ``beat`` says this host
    is alive, and on the host ``serving`` the store returns the hosts newly taken for lost (``gone``:
    lost already). Each beat also reads the store's ``keys`` into ``known``: what a successor
    serving the store starts from (succession.py)."""

    def __init__(self, store: dist.Store, place: Hosts, serving: bool, gone=(), keys=()):
        self.store, self.place, self.serving, self.keys, self.due = store, place, serving, keys, 0.0
        others = [k for k in range(place.count) if k != place.rank and k not in gone] if serving else []
        now = time.monotonic()
        self.heard = {k: (-1, now) for k in others}  # host -> (its counter, when it last moved)
        self.lost: set[int] = set()
        self.known: dict[str, int] = {}

    def beat(self) -> list[int]:
        """Every BEAT_S: this host's heartbeat; the serving host's newly lost hosts (marked lost in
        the store). Raises Fenced on a host taken for lost, and the store's error when it is gone."""
        now = time.monotonic()
        if self.place.count == 1 or now < self.due:
            return []
        self.due = now + BEAT_S
        self.store.add(f"distlib/alive/{self.place.rank}", 1)
        self.known = {key: self.store.add(key, 0) for key in self.keys}
        if not self.serving:
            if self.store.check([lost_key(self.place.rank)]):
                raise Fenced(
                    f"error: the job took node {self.place.rank} for lost (no heartbeat for {LOST_S:g} s) "
                    "and runs its ranks elsewhere: this node's workers are stopped"
                )
            return []
        return [k for k in self.heard if self._silent(k, now)]

    def _silent(self, k: int, now: float) -> bool:
        """Whether host ``k`` is newly lost: silent for LOST_S, not finished (then marked)."""
        if k in self.lost:
            return False
        count = self.store.add(f"distlib/alive/{k}", 0)
        if count != self.heard[k][0]:
            self.heard[k] = (count, now)
            return False
        if now - self.heard[k][1] < LOST_S or self.store.check([done_key(k)]):
            return False
        self.lost.add(k)
        self.store.set(lost_key(k), "1")
        return True
