"""The job's store as one host's agent holds it (agent.py): served by this process (a one-host
job's, node 0's, or node 0's successor's) or joined; this host's heartbeat and, on the host serving
it, the hosts found lost (heartbeats.Watch); and the store's move to another host when node 0 is lost
(succession.py)."""

from __future__ import annotations

import sys

import torch.distributed as dist

from distlib.launch import generations, heartbeats, hosts, succession
from distlib.launch.hosts import Hosts

RESTARTS = "distlib/restarts"  # restarts used by the job, every host's (a counter)


class JobStore:
    def __init__(self, place: Hosts, timeout_s: float, store: dist.TCPStore | None = None):
        """``store``: node 0's, which a host other than node 0 has joined already (node 0 and a
        one-host job serve their own)."""
        self.place, self.timeout_s = place, timeout_s
        self.store = store if store is not None else hosts.serve(place.address, timeout_s)
        self.address = place.address or ("127.0.0.1", self.store.port)
        self.serving = place.rank == 0  # whether this process serves it
        self.offers: list[succession.Offer] = []  # where it goes should node 0 be lost
        self.watch = self._watching()

    @property
    def env(self) -> dict[str, str]:
        """Where a worker finds it."""
        return {"MASTER_ADDR": self.address[0], "MASTER_PORT": str(self.address[1])}

    def open(self, tree: dict, run_dir: str) -> None:
        """Node 0 counts generations from 0 and, over several hosts, publishes the job, waits until
        every host has joined (the others joined before their agent was made: hosts.job) and lists
        where the store would go."""
        if self.place.rank != 0:
            return
        self.store.add(generations.KEY, 0)
        if self.place.count > 1:
            hosts.publish(self.store, tree, run_dir, self.place.argv)
            hosts.await_hosts(self.store, self.place.count, self.timeout_s)
            succession.collect(self.store, self.place.count)
            self.watch = self._watching()  # (silence is counted from now)

    def _watching(self, gone=()) -> heartbeats.Watch:
        return heartbeats.Watch(self.store, self.place, self.serving, gone, (generations.KEY, RESTARTS))

    def beat(self) -> list[int]:
        """This host's heartbeat; on the host serving the store, the hosts newly lost. Raises
        heartbeats.Fenced on a host taken for lost, and the store's error when it is gone."""
        lost = self.watch.beat()
        if self.place.count > 1 and not self.offers:  # (listed by node 0 before any worker ran)
            self.offers = succession.listed(self.store)
        return lost

    def gone(self) -> str:
        return f"node 0 (the job's store at {self.address[0]}:{self.address[1]} is gone)"

    def move(self) -> list[int] | None:
        """Node 0's store is gone: it moves to the first host after node 0 that answers, or this
        one (succession.take_over). The hosts whose ranks this host must now run (those before
        it, when it serves the new store); None when the store could not move (node 0 itself, one
        host)."""
        if self.serving or not self.offers:
            return None
        known = dict(self.watch.known)
        known[generations.KEY] = known.get(generations.KEY, 0) + 1  # (past one begun unseen)
        try:
            taken = succession.take_over(self.offers, self.place.rank, self.timeout_s, known)
        except (RuntimeError, OSError):
            return None
        old, (self.store, self.address, self.serving) = self.gone(), taken
        lost = range(self.place.rank) if self.serving else ()
        self.watch = self._watching(lost)
        if self.serving:
            where = f"{self.address[0]}:{self.address[1]}"
            print(f"{old}: node {self.place.rank} serves it now, at {where}", file=sys.stderr, flush=True)
            for host in lost:
                self.store.set(heartbeats.lost_key(host), "1")
        return list(lost)
