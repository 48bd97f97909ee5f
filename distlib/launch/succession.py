"""Where the job's store goes when node 0 is lost (a job over several hosts: hosts.py).

Node 0's agent serves the store every host and worker of the job meets at; losing node 0 would
lose the job's count of generations and restarts, and with it the job. So every other host offers,
when it joins, an address where it would serve the store instead (``offer``: the address it
reaches node 0 from, and a port free then), and node 0 lists the offers in one key before any
worker starts (``collect``), which every agent and worker reads while the store is there
(``listed``).

When the store is gone, host k's agent (``take_over``) tries the stores offered by hosts 1 .. k - 1
for up to ``TURN_S`` per host, and joins the first that answers; when none does, it serves the
store itself on its offered address, with what it knew of the job (the newest generation and the
restarts used, read every heartbeat), and takes the hosts before it for lost. Host 1 serves at
once. A worker waiting for the next generation finds the new store the same way
(``generations.next_generation``), trying the offered addresses in turn.
"""

from __future__ import annotations

import datetime
import json
import socket
import time

import torch.distributed as dist

SUCCESSORS = "distlib/successors"  # [[host, address, port], ...] for hosts 1 .. n - 1
# How long host k waits for each host before it to serve the store: host 1 starts one at once (it
# sees the loss within a heartbeat, 0.1 s), so 2 s is a host that is gone too.
TURN_S = 2.0
POLL_S = 0.02

Offer = tuple[int, str, int]  # (host, address, port)


def _key(host: int) -> str:
    return f"distlib/successor/{host}"


def offer(store: dist.Store, host: int, node0: tuple[str, int]) -> None:
    """Host ``host`` (> 0): where it would serve the store, should node 0 be lost: the address it
    reaches node 0 from (the others reach it there too) and a port free now."""
    with socket.create_connection(node0, timeout=10) as s:
        address = s.getsockname()[0].removeprefix("::ffff:")
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        port = s.getsockname()[1]
    store.set(_key(host), f"{address}:{port}")


def collect(store: dist.Store, count: int) -> None:
    """Node 0, every host joined: the offers of hosts 1 .. count - 1 in one key."""
    offers = []
    for host in range(1, count):
        address, _, port = store.get(_key(host)).decode().rpartition(":")
        offers.append([host, address, int(port)])
    store.set(SUCCESSORS, json.dumps(offers))


def listed(store: dist.Store) -> list[Offer]:
    """The offers node 0 collected (none: one host)."""
    return [tuple(o) for o in json.loads(store.get(SUCCESSORS))] if store.check([SUCCESSORS]) else []


def answers(address: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether a store at ``address``:``port`` accepts a connection (a plain socket's: torch's
    client logs each failed try with its C++ stack)."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def first_answering(offers: list[Offer], deadline: float) -> Offer | None:
    """The first of ``offers`` whose store answers before ``deadline``, trying them in turn."""
    while time.monotonic() < deadline:
        for found in offers:
            if answers(found[1], found[2]):
                return found
        time.sleep(POLL_S)
    return None


def take_over(offers: list[Offer], me: int, timeout_s: float, known: dict[str, int]) -> tuple:
    """Node 0's store is gone: (the store, its (address, port), whether this host serves it).
    A lower host's if one answers in its turn; else this host's own, on its offered address, set
    from ``known`` (store key -> value: the generations begun, the restarts used)."""
    before = [o for o in offers if o[0] < me]
    found = first_answering(before, time.monotonic() + TURN_S * len(before)) if before else None
    timeout = datetime.timedelta(seconds=timeout_s)
    if found is not None:
        return dist.TCPStore(found[1], found[2], is_master=False, timeout=timeout), found[1:], False
    ((_, address, port),) = [o for o in offers if o[0] == me]
    store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False, timeout=timeout)
    for key, value in known.items():
        store.add(key, value)
    return store, (address, port), True
