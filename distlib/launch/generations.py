"""Generations of one job's process group, when a lost rank is replaced and the others stay.

Under ``python train.py dist.max_restarts=N`` (``distlib/launch/agent.py``) a worker killed by a
signal is replaced by a new worker, and the other ranks keep their processes: they leave the
broken process group and join a new one with the replacement. Each group is a *generation*,
numbered from 0. The agent hosts one TCPStore for the whole job (node 0's agent, when the job
spans hosts: every host's agent replaces its own workers); generation g's process group keeps its
keys under its own prefix there (a dead generation's gloo addresses are never read again). ``KEY``
counts the generations: an agent that lost a worker adds one (``begin``) and starts the
replacement knowing the number it got (``ENV``); a survivor waits for the count to move past its
own. Two hosts losing a worker at once make two generations, and the ranks of the first, finding a
later one begun before theirs formed, move on to it (``assemble``). ``END_KEY``, once set, says no
generation follows (no restart left, or a host ended the job): the survivors then leave with their
own error.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from distlib.launch import succession
from distlib.launch.heartbeats import lost_key
from distlib.launch.torchrun import ATTEMPT_ENV

ENV = "DISTLIB_GENERATION"  # this worker's generation; set only under the agent
KEY = "distlib/generation"  # the newest generation begun (a counter: ``dist.Store.add``)
END_KEY = "distlib/generation_end"  # set once no generation follows: why, in words
END = "end"
# How long a survivor waits for the next generation. The agent starts it within its poll (10 ms) of
# a worker's death; a survivor that gets none waited on a rank that hung rather than died (or the
# agent has no restart left), and leaves with its error.
WAIT_S = 10.0


def in_place() -> bool:
    """Whether this worker's launcher replaces a lost rank while the others stay."""
    return ENV in os.environ


def current() -> int:
    return int(os.environ[ENV])


_BASE: list[dist.TCPStore] = []  # this process's one client of the job's store
_AT: list[tuple[str, str]] = []  # where that client is connected
_OFFERS: list[succession.Offer] = []  # where the store goes should node 0 be lost (several hosts)


def base_store(timeout_s: float) -> dist.TCPStore:
    """The job's store, through one connection while it stays where it is (MASTER_ADDR:PORT): a
    survivor asks it for each generation (a new connection each time would pay TCPStore's connect,
    and its retries when the agent is busy, on a recovery's critical path). The first connection
    also reads where the store would go (succession.listed)."""
    at = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    if _AT != [at]:
        timeout = datetime.timedelta(seconds=timeout_s)
        _BASE[:] = [dist.TCPStore(at[0], int(at[1]), is_master=False, timeout=timeout)]
        _AT[:] = [at]
        _OFFERS[:] = _OFFERS or succession.listed(_BASE[0])
    return _BASE[0]


def store(timeout_s: float) -> dist.Store:
    """This generation's store: the agent's, under the generation's own key prefix."""
    return dist.PrefixStore(f"distlib/generation_{current()}", base_store(timeout_s))


def enter(generation: int) -> None:
    """Make ``generation`` this worker's (and its launcher attempt, which fault injection and the
    metrics log read: distlib/app/runtime/launcher_env.py)."""
    os.environ[ENV] = os.environ[ATTEMPT_ENV] = str(generation)


def begin(store: dist.Store) -> int:
    """A new generation (an agent lost a worker): its number."""
    return store.add(KEY, 1)


def end(store: dist.Store, why: str) -> None:
    """No generation follows; ``why`` in words."""
    store.set(END_KEY, why)


def ended(store: dist.Store) -> str | None:
    """Why no generation follows, once an agent said so; else None."""
    return store.get(END_KEY).decode() if store.check([END_KEY]) else None


def _newer(base: dist.TCPStore, mine: int) -> int | str | None:
    """The newest generation if it is past ``mine``, END when none follows, else None. A store
    that is gone (the host serving it was lost) is END: nothing can follow."""
    try:
        if base.check([END_KEY]):
            return END
        newest = base.add(KEY, 0)
    except (RuntimeError, OSError):  # torch's DistNetworkError and kin: the store's host is gone
        return END
    return newest if newest > mine else None


def next_generation(timeout_s: float, poll_s: float = 0.005) -> int | None:
    """Wait until the agent starts a generation after this worker's own; its number, or None when
    the agent says none follows or none has started within WAIT_S (at most ``timeout_s``, the
    store's)."""
    deadline = time.monotonic() + min(WAIT_S, timeout_s)
    if not _reachable() and not _moved(deadline):
        return None  # node 0 is gone with its store, and none took it over: nothing can follow
    base, mine = base_store(timeout_s), current()
    if fenced(base):
        return None
    while time.monotonic() < deadline:
        newer = _newer(base, mine)
        if newer is not None:
            return None if newer == END else newer
        time.sleep(poll_s)
    return None


def _reachable() -> bool:
    """Whether the job's store still accepts a connection (asking it when it is gone, torch logs
    30 lines)."""
    return succession.answers(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 1.0)


def _moved(deadline: float) -> bool:
    """Whether the store moved to a host that offered to serve it (succession.py) before
    ``deadline``; this process then asks it from now on."""
    found = succession.first_answering(_OFFERS, deadline)
    if found is None:
        return False
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = found[1], str(found[2])
    return True


def fenced(base: dist.TCPStore) -> bool:
    """Whether the host serving the store took this worker's host for lost (its ranks run
    elsewhere now): a worker of such a host enters no later generation (heartbeats.py)."""
    try:
        return base.check([lost_key(int(os.environ.get("GROUP_RANK", "0")))])
    except (RuntimeError, OSError):  # the store is gone: _newer says END
        return False


def assemble(world_size: int, timeout_s: float, poll_s: float = 0.005) -> bool:
    """Wait until all ``world_size`` ranks of this worker's generation have arrived, before any of
    them forms its process group: True then; False when a later generation started meanwhile (a
    rank of this one was lost while it formed, and torch's rendezvous would have waited out the
    timeout for it). Raises TimeoutError naming the count after ``timeout_s``, or when the agent
    says no generation follows."""
    base, mine = base_store(timeout_s), current()
    arrived = f"distlib/generation_{mine}/arrived"
    count = base.add(arrived, 1)
    deadline = time.monotonic() + timeout_s
    while count < world_size:
        newer = _newer(base, mine)
        if newer is not None and newer != END:
            return False
        if newer == END or time.monotonic() > deadline:
            raise TimeoutError(f"{count} of {world_size} ranks of generation {mine} arrived")
        time.sleep(poll_s)
        count = base.add(arrived, 0)
    return True
