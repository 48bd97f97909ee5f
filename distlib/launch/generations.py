"""Generations of one job's process group, when a lost rank is replaced and the others stay.

Under ``python train.py dist.max_restarts=N`` (``distlib/launch/agent.py``) a worker killed by a
signal is replaced by a new worker, and the other ranks keep their processes: they leave the
broken process group and join a new one with the replacement. Each group is a *generation*,
numbered from 0. The agent hosts one TCPStore for the whole job; generation g's process group
keeps its keys under its own prefix there (a dead generation's gloo addresses are never read
again), and the agent publishes the current generation under ``KEY``: a survivor waits for it to
move past its own, a replacement is started knowing it (``ENV``). ``END`` instead of a number says
no generation follows (no restart left): the survivors then leave with their own error.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from distlib.launch.torchrun import ATTEMPT_ENV

ENV = "DISTLIB_GENERATION"  # this worker's generation; set only under the agent
KEY = "distlib/generation"  # the agent's current generation, or END
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


_BASE: list[dist.TCPStore] = []  # this process's one client of the agent's store


def base_store(timeout_s: float) -> dist.TCPStore:
    """The agent's store, through one connection for the life of the process: a survivor asks it
    for each generation (a new connection each time would pay TCPStore's connect, and its retries
    when the agent is busy, on a recovery's critical path)."""
    if not _BASE:
        _BASE.append(
            dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        )
    return _BASE[0]


def store(timeout_s: float) -> dist.Store:
    """This generation's store: the agent's, under the generation's own key prefix."""
    return dist.PrefixStore(f"distlib/generation_{current()}", base_store(timeout_s))


def enter(generation: int) -> None:
    """Make ``generation`` this worker's (and its launcher attempt, which fault injection and the
    metrics log read: distlib/app/runtime/launcher_env.py)."""
    os.environ[ENV] = os.environ[ATTEMPT_ENV] = str(generation)


def _newer(base: dist.TCPStore, mine: int) -> int | str | None:
    """The agent's generation if it has moved past ``mine`` (or END), else None."""
    value = base.get(KEY).decode()
    if value == END:
        return END
    return int(value) if int(value) > mine else None


def next_generation(timeout_s: float, poll_s: float = 0.005) -> int | None:
    """Wait until the agent starts a generation after this worker's own; its number, or None when
    the agent says none follows or none has started within WAIT_S (at most ``timeout_s``, the
    store's)."""
    base, mine = base_store(timeout_s), current()
    deadline = time.monotonic() + min(WAIT_S, timeout_s)
    while time.monotonic() < deadline:
        newer = _newer(base, mine)
        if newer is not None:
            return None if newer == END else newer
        time.sleep(poll_s)
    return None


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
