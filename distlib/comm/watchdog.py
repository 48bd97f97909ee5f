"""Turn a failed collective into an error that names the step and the ranks that did not arrive.

Every collective runs under the process group's timeout (``dist.timeout_s``); when a
wait fails, the rank only knows which peer it was waiting on, and in a ring that peer
may itself be waiting on someone else. So each failing rank posts a short report to
the process group's key-value store (torch's TCPStore) and waits a little for the
others' reports: a rank that sent none never reached a collective that could fail,
i.e. it stalled (or died) before arriving. The roll call ends as soon as every peer has
reported or is known dead: each rank announces its host and pid when it joins
(``announce``), so a dead peer on this host is seen at once (a SIGKILLed worker's survivors
name it within milliseconds, instead of waiting out the grace period). All names are global ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

import torch.distributed as dist

from distlib.comm.group import Comm
from distlib.comm.p2p import CollectiveError, CollectiveMismatchError


class StallError(RuntimeError):
    """A collective timed out or lost a peer; the message names where and who did not arrive."""


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no process group / store: report without the roll call
        return None


_PROC = "distlib/proc/"


def announce() -> None:
    """Publish this rank's host and pid in the process group's store (call once after joining)."""
    store = _store()
    if store is not None:
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        store.set(_PROC + str(dist.get_rank()), json.dumps(me))


def _exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (dead, not yet reaped by its launcher)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def _local_pids(store, ranks) -> dict[int, int]:
    """rank -> pid of the given ranks that announced a process on this host."""
    host, pids = socket.gethostname(), {}
    for r in ranks:
        if store.check([_PROC + str(r)]):
            proc = json.loads(store.get(_PROC + str(r)))
            if proc["host"] == host:
                pids[r] = int(proc["pid"])
    return pids


def grace_seconds(timeout_s: float) -> float:
    """How long a failing rank waits for the others' reports (they time out at about the same time)."""
    return min(timeout_s / 2, 5.0)


# Once a peer is known dead, the failure is explained: the roll call waits only this much more
# for the others' reports. Waiting out the grace instead added 5 s to 1-4 of 20 kills'
# recoveries (benchmarks/chaos.py): a survivor blocked on a live rank -- itself in this roll
# call -- never reports until that rank leaves.
SETTLE_S = 0.25


def _roll_call(store, prefix: str, comm: Comm, me: int, grace: float) -> tuple[dict[int, dict], set[int]]:
    """The peers' reports and the peers seen exited on this host, within ``grace`` seconds (or
    SETTLE_S after the first dead peer)."""
    reports: dict[int, dict] = {}
    dead: set[int] = set()
    deadline, local = time.monotonic() + grace, _local_pids(store, comm.ranks)
    while True:
        for r in comm.ranks:
            if r != me and r not in reports and store.check([prefix + str(r)]):
                reports[r] = json.loads(store.get(prefix + str(r)))
            elif r != me and r not in reports and r in local and _exited(local[r]):
                if not dead:
                    deadline = min(deadline, time.monotonic() + SETTLE_S)
                dead.add(r)
        if len(reports) + len(dead) == comm.size - 1 or time.monotonic() >= deadline:
            return reports, dead
        time.sleep(0.01)


def _waiting(peer: int | None, words: str) -> str:
    """Which rank a failed wait was on; torch's own collectives (``native``) do not say."""
    return "" if peer is None else f" ({words} rank {peer})"


def diagnose(error: CollectiveError, where: str, comm: Comm, timeout_s: float) -> RuntimeError:
    if isinstance(error, CollectiveMismatchError):  # said where, whether every rank raised it or one
        return CollectiveMismatchError(f"{where}: {error}", error.collective, agreed=error.agreed)
    me = comm.peer(comm.rank)
    store, grace = _store(), grace_seconds(timeout_s)
    reports: dict[int, dict] = {}
    dead: set[int] = set()
    if store is not None:
        prefix = "distlib/stall/" + "_".join(map(str, comm.ranks)) + "/"
        try:
            report = {"where": where, "collective": error.collective, "peer": error.peer}
            store.set(prefix + str(me), json.dumps(report))
            reports, dead = _roll_call(store, prefix, comm, me, grace)
        except Exception:  # noqa: BLE001 - the store may be gone with the launcher
            store = None
    head = f"{where}: {error.collective} did not complete on rank {me} within dist.timeout_s={timeout_s:g}s"
    head += _waiting(error.peer, "it was waiting on")
    if store is None:
        return StallError(f"{head}; could not ask the other ranks which did not arrive. Cause: {error}")
    missing = [r for r in comm.ranks if r != me and r not in reports]
    exited, silent = [r for r in missing if r in dead], [r for r in missing if r not in dead]
    others = ", ".join(
        f"rank {r} at {rep['where']} in {rep['collective']}" + _waiting(rep["peer"], "waiting on")
        for r, rep in sorted(reports.items())
    )
    if exited:
        verdict = f"rank(s) {exited} did not arrive: their process(es) on this host exited"
        verdict += f" (rank(s) {silent} had not reported yet)" if silent else ""
    elif missing:
        verdict = (
            f"rank(s) {missing} did not arrive: no report from them within {grace:g}s after the "
            f"timeout (stalled or dead)"
        )
    else:
        verdict = "every rank reported a failure, none is missing (a lost connection?)"
    return StallError(
        f"{head}; {verdict}" + (f"; also failed: {others}" if others else "") + f". Cause: {error}"
    )


@contextlib.contextmanager
def watch(where: str, comm: Comm, timeout_s: float):
    """Re-raise a collective failure inside the block as a diagnosed error for ``where``."""
    try:
        yield
    except CollectiveError as exc:
        raise diagnose(exc, where, comm, timeout_s) from exc
