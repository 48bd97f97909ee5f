"""A job of ``python train.py dist.max_restarts=K`` (its own launcher: a lost worker is replaced and
the others stay) whose workers can be killed: the same interface as _torchrun_job.Job, for
benchmarks/chaos.py and tests/test_chaos.py.

The workers are forks of the launcher's fork server, named ``distlib-rank<R>`` (/proc/<pid>/comm),
which is how a worker's rank is found here. After a kill, ``phases`` gives the seconds to the
first step of the next generation (rank 0 logs a step once every rank has finished it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _torchrun_job import ROOT, Job, _alive, _children  # noqa: E402

PREFIX = "distlib-rank"


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class OwnJob(Job):
    def __init__(self, run_dir: Path, overrides: list[str], nproc: int = 4, max_restarts: int = 0):
        super().__init__(run_dir, overrides, nproc, max_restarts)
        self.cmd = [
            sys.executable,
            str(ROOT / "train.py"),
            f"hydra.run.dir={self.run_dir}",
            f"dist.world_size={nproc}",
            f"dist.max_restarts={max_restarts}",
            *overrides,
        ]

    def ranks(self) -> dict[int, int]:
        """rank -> pid of this job's live workers: the children of the launcher's children (its
        fork server's) named as workers."""
        found = {}
        for child in _children(self.proc.pid):
            for pid in _children(child):
                name = _name(pid)
                if name.startswith(PREFIX) and _alive(pid):
                    found[int(name[len(PREFIX) :])] = pid
        return found

    def workers(self) -> list[int]:
        return sorted(self.ranks().values())

    def _watch(self) -> None:
        """Every worker process seen, and when (``seen``, as the torchrun job's)."""
        while not self._stop.is_set():
            now = time.time()
            for pid in self.workers():
                self.seen.setdefault(pid, [now, now])[1] = now
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
