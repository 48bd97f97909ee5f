"""A job of ``python train.py dist.max_restarts=K`` (its own launcher: a lost worker is replaced and
the others stay) whose workers can be killed: the same interface as _torchrun_job.Job, for
benchmarks/chaos.py and tests/test_chaos.py.

The workers are forks of the launcher's fork server, named ``distlib-rank<R>`` (/proc/<pid>/comm),
which is how a worker's rank is found here; idle standbys (``dist.standbys``) are named
``distlib-standby`` until they take a rank's place. After a kill, ``phases`` gives the seconds to the
first step of the next generation (rank 0 logs a step once every rank has finished it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _torchrun_job import ROOT, Job, _alive, _children  # noqa: E402

PREFIX = "distlib-rank"
STANDBY = "distlib-standby"


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class OwnJob(Job):
    def __init__(self, run_dir: Path, overrides: list[str], nproc: int = 4, max_restarts: int = 0):
        super().__init__(run_dir, overrides, nproc, max_restarts)
        self.standby_seen: dict[int, float] = {}  # standby pid -> when first seen idle
        self.cmd = [
            sys.executable,
            str(ROOT / "train.py"),
            f"hydra.run.dir={self.run_dir}",
            f"dist.world_size={nproc}",
            f"dist.max_restarts={max_restarts}",
            *overrides,
        ]

    def _forked(self) -> dict[int, str]:
        """pid -> name of the live children of the launcher's children (its fork server's)."""
        found = {}
        for child in _children(self.proc.pid):
            for pid in _children(child):
                if _alive(pid):
                    found[pid] = _name(pid)
        return found

    def ranks(self) -> dict[int, int]:
        """rank -> pid of this job's live workers."""
        return {int(n[len(PREFIX) :]): pid for pid, n in self._forked().items() if n.startswith(PREFIX)}

    def standbys(self) -> list[int]:
        """The pids of this job's idle standbys."""
        return sorted(pid for pid, name in self._forked().items() if name == STANDBY)

    def standby_memory(self) -> list[dict[str, int]]:
        """Each idle standby's memory in bytes (/proc/<pid>/smaps_rollup): ``private`` (its own
        pages) and ``pss`` (with its share of the pages it shares with the fork server)."""
        out = []
        for pid in self.standbys():
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    kb = {line.split(":")[0]: int(line.split()[1]) for line in f if line.endswith("kB\n")}
            except OSError:
                continue
            out.append(
                {"private": 1024 * (kb["Private_Clean"] + kb["Private_Dirty"]), "pss": 1024 * kb["Pss"]}
            )
        return out

    def workers(self) -> list[int]:
        return sorted(self.ranks().values())

    def _watch(self) -> None:
        """Every worker process seen, and when (``seen``, as the torchrun job's)."""
        while not self._stop.is_set():
            now = time.time()
            for pid, name in self._forked().items():
                if name.startswith(PREFIX):
                    self.seen.setdefault(pid, [now, now])[1] = now
                elif name == STANDBY:
                    self.standby_seen.setdefault(pid, now)
            time.sleep(0.005)

    def phases(self, t_kill: float, victim: int | None, attempt: int) -> dict[str, float | None]:
        """Seconds from a kill at ``t_kill`` to the replacement's start and to the first step of
        the generation after it."""
        records = self.records()
        restart = next((r for r in records if r.get("event") == "restart" and r["time"] > t_kill), None)
        steps = [
            r["time"] for r in records if r["type"] == "step" and restart and r["time"] > restart["time"]
        ]
        new = [first for first, _ in self.seen.values() if first > t_kill]
        return {
            "workers started": min(new) - t_kill if new else None,
            "first step": min(steps) - t_kill if steps else None,
        }


class StandbyJob(OwnJob):
    """An OwnJob with one warm standby (``dist.standbys=1``): a lost worker's place goes to it."""

    def __init__(self, run_dir: Path, overrides: list[str], nproc: int = 4, max_restarts: int = 0):
        super().__init__(run_dir, [*overrides, "dist.standbys=1"], nproc, max_restarts)
