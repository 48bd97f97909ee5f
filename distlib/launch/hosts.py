"""A job of ``python train.py`` over several hosts (``dist.nodes``): where each host's workers sit,
and how the hosts meet.

The same command runs on every host, each with its own ``dist.node_rank``. Node 0 is the host
that composes the configuration (Hydra), takes the run directory's lock and writes its files,
exactly as a one-host job does, and its agent serves the job's store at ``dist.store``'s port.
Every other host composes nothing: its launcher (``follower``, found on the command line before
Hydra runs) connects to that store, takes node 0's checked configuration and run directory, and
checks that its command line is node 0's but for the node rank. Each host's agent (agent.py) then
starts its own ``world_size / nodes`` workers, global ranks ``node_rank x that`` onward, and
replaces those it loses while every other rank, on every host, stays.

The keys of the meeting, in the job's store: ``JOB`` (node 0's configuration, run directory and
command line), one ``host/<k>`` per host that joined (a second host with the same node rank is
refused). Once the job runs, the hosts watch each other through the store (heartbeats.py), and
the store itself moves should node 0 be lost (succession.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import socket
import sys
import time

import torch.distributed as dist

from distlib.app.config.run import ConfigError, RunConfig

JOB = "distlib/job"
_NODE_RANK, _STORE, _TIMEOUT = "dist.node_rank", "dist.store", "dist.timeout_s"
POLL_S = 0.01


class HostError(RuntimeError):
    """A host that cannot join the job (or a job a host never joined): its one line, and the exit
    status (2: a configuration's error, as train.py's others)."""

    @property
    def code(self) -> int:
        return 2 if str(self).startswith("config error") else 1

    def leave(self):
        print(self, file=sys.stderr)
        sys.exit(self.code)


@dataclasses.dataclass(frozen=True)
class Hosts:
    """This launcher's place in the job: ``count`` hosts, this one ``rank``; ``address``: the
    store's (None: one host, its agent's own store on a free port); ``argv``: the command line, as
    node 0 publishes it and the others check theirs against it."""

    count: int = 1
    rank: int = 0
    address: tuple[str, int] | None = None
    argv: tuple[str, ...] = ()

    def ranks(self, world_size: int) -> range:
        """The global ranks of this host's workers."""
        local = world_size // self.count
        return range(self.rank * local, (self.rank + 1) * local)


ONE_HOST = Hosts()


def _value(argv: list[str], key: str) -> str | None:
    """The value the command line gives ``key`` (``key=value``, ``+key=`` or ``++key=``), else None."""
    found = None
    for arg in argv:
        name, sep, value = arg.lstrip("+").partition("=")
        if sep and name == key:
            found = value
    return found


def follower(argv: list[str]) -> tuple[int, str | None, float] | None:
    """(node rank, dist.store as given, dist.timeout_s) when this command is a host other than
    node 0 of a several-host job (``dist.node_rank`` > 0 on the command line); None for node 0 and
    every one-host job, which Hydra composes as usual. Raises HostError for a node rank or timeout
    that is no number."""
    given = _value(argv, _NODE_RANK)
    if given is None:
        return None
    try:
        rank, timeout_s = int(given), float(_value(argv, _TIMEOUT) or 60.0)
    except ValueError as exc:
        raise HostError(f"config error: {_NODE_RANK}={given} or {_TIMEOUT} is not a number ({exc})") from exc
    return (rank, _value(argv, _STORE), timeout_s) if rank > 0 else None


def same_command(mine: list[str], node0: list[str]) -> str | None:
    """Why this host's command line is not node 0's but for the node rank (None: it is)."""

    def without_rank(argv):
        return [a for a in argv if a.lstrip("+").partition("=")[0] != _NODE_RANK]

    ours, theirs = without_rank(mine), without_rank(node0)
    if ours == theirs:
        return None
    return (
        f"this host's command line differs from node 0's (every host runs the same one but for "
        f"{_NODE_RANK}): here {' '.join(ours) or '(nothing)'}; on node 0 {' '.join(theirs) or '(nothing)'}"
    )


def serve(address: tuple[str, int] | None, timeout_s: float) -> dist.TCPStore:
    """The job's store, served by this process: on ``address``'s port (node 0 of several hosts), or
    on a free port of the loopback (one host)."""
    host, port = address or ("127.0.0.1", 0)
    try:
        return dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except (RuntimeError, OSError) as exc:
        line = f"error: node 0 cannot serve the job's store on port {port} (dist.store): {first_line(exc)}"
        raise HostError(line) from exc


def connect(address: tuple[str, int], timeout_s: float) -> dist.TCPStore:
    """A client of node 0's store; HostError naming it if it does not answer within ``timeout_s``.
    The address is first tried with plain sockets: torch's client logs each failed try with its
    C++ stack (30 lines) before it gives up."""
    host, port = address
    deadline, why = time.monotonic() + timeout_s, "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())):
                break
        except OSError as exc:
            why = first_line(exc)
        if time.monotonic() > deadline:
            raise HostError(
                f"error: node 0's store at {host}:{port} (dist.store) did not answer within "
                f"dist.timeout_s={timeout_s:g}s ({why}): start node 0 with the same command, "
                "or check the address"
            )
        time.sleep(POLL_S * 10)
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise HostError(f"error: node 0's store at {host}:{port} (dist.store): {first_line(exc)}") from exc


def first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def publish(store: dist.Store, tree: dict, run_dir: str, argv: tuple[str, ...]) -> None:
    """Node 0's configuration, run directory and command line, for the other hosts."""
    store.set(JOB, json.dumps({"tree": tree, "run_dir": run_dir, "argv": list(argv)}))


def job(store: dist.Store, argv: list[str], rank: int, timeout_s: float) -> tuple[dict, str]:
    """Node 0's (tree, run directory), once it has published them, this host joined as node ``rank``;
    HostError when node 0 publishes none in time, the command lines differ, or the rank is
    another host's or none of the job's."""
    try:
        store.wait([JOB], datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise HostError(
            f"error: node 0 published no configuration within dist.timeout_s={timeout_s:g}s "
            f"(see node 0's output): {first_line(exc)}"
        ) from exc
    shared = json.loads(store.get(JOB))
    problem = same_command(argv, shared["argv"])
    if problem:
        raise HostError(f"config error: {problem}")
    tree = shared["tree"]
    try:  # this host's rank checked where every key is (DistConfig.check)
        RunConfig.from_dict({**tree, "dist": {**tree["dist"], "node_rank": rank}})
    except ConfigError as exc:
        raise HostError(f"config error: {exc}") from exc
    if store.add(f"distlib/host/{rank}", 1) > 1:
        raise HostError(f"config error: another host already joined this job as {_NODE_RANK}={rank}")
    return shared["tree"], shared["run_dir"]


def await_hosts(store: dist.Store, count: int, timeout_s: float) -> None:
    """Node 0: wait until hosts 1 .. count - 1 joined; HostError naming those that did not."""
    keys = [f"distlib/host/{k}" for k in range(1, count)]
    deadline = time.monotonic() + timeout_s
    while not all(store.check([key]) for key in keys):
        if time.monotonic() > deadline:
            missing = [k for k, key in enumerate(keys, 1) if not store.check([key])]
            raise HostError(
                f"error: node(s) {missing} of dist.nodes={count} did not join within "
                f"dist.timeout_s={timeout_s:g}s (run the same command there with dist.node_rank set)"
            )
        time.sleep(POLL_S)
