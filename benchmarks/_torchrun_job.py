"""A traced torchrun job of train.py whose workers can be killed, and where the time went after each kill.

Used by benchmarks/recovery.py, benchmarks/chaos.py and tests/test_chaos.py. The job runs
``torchrun --nproc_per_node N --max-restarts K`` with benchmarks/_trace_worker.py in front of
train.py (each worker appends marks: imports done, process group formed, state restored, first
step, a peer lost, the launcher's signal, leaving). A thread here lists torchrun's children every
5 ms, so when each worker process appeared and vanished is known without its help. After a kill
at time t, ``phases`` gives seconds from t to: noticed (the first survivor that saw a failed
collective or the launcher's signal), survivors gone (every other worker of that start exited),
workers started, imports done, group formed, state restored, first step (of the next start, the
slowest rank of each).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _trace_worker import compile_distlib, read  # noqa: E402

PHASES = (
    "noticed",
    "survivors gone",
    "workers started",
    "imports done",
    "group formed",
    "state restored",
    "first step",
)
_NEXT_START = {
    "imports done": "import distlib",
    "group formed": "process group",
    "state restored": "state restored",
    "first step": "first step",
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def _rank_of(pid: int) -> int:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return int(env[b"RANK"])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


class Job:
    def __init__(self, run_dir: Path, overrides: list[str], nproc: int = 4, max_restarts: int = 0):
        self.run_dir, self.trace_dir = Path(run_dir), Path(run_dir).parent / (Path(run_dir).name + ".trace")
        self.cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{_port()}",
            "--monitor-interval=0.1",
            str(HERE / "_trace_worker.py"),
            str(ROOT / "train.py"),
            f"hydra.run.dir={self.run_dir}",
            *overrides,
        ]
        self.seen: dict[int, list[float]] = {}  # worker pid -> [first seen, last seen alive]
        self._stop = threading.Event()

    def start(self) -> Job:
        compile_distlib(str(ROOT))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DISTLIB_TRACE_DIR": str(self.trace_dir)}
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._out = {}
        for name in ("stdout", "stderr"):  # drained in threads: a full pipe would stall torchrun
            t = threading.Thread(target=self._drain, args=(name,), daemon=True)
            t.start()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()
        return self

    def _drain(self, name: str) -> None:
        self._out[name] = getattr(self.proc, name).read()

    def _watch(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for pid in _children(self.proc.pid):
                if _alive(pid):
                    self.seen.setdefault(pid, [now, now])[1] = now
            time.sleep(0.005)

    def records(self) -> list[dict]:
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def last_step(self) -> int:
        return max((r["step"] for r in self.records() if r["type"] == "step"), default=0)

    def wait_for(self, condition, timeout: float = 120.0, what: str = "a condition") -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the job ended or timed out waiting for {what}: {self.tail()}")
            time.sleep(0.005)

    def workers(self) -> list[int]:
        return sorted(pid for pid in _children(self.proc.pid) if _alive(pid))

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the live workers (torchrun's each have RANK in their environment)."""
        return {_rank_of(pid): pid for pid in self.workers()}

    def kill(self, pid: int) -> float:
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        return t

    def finish(self, timeout: float = 600.0) -> int:
        code = self.proc.wait(timeout=timeout)
        self._stop.set()
        self._watcher.join()
        time.sleep(0.05)
        return code

    def output(self) -> tuple[str, str]:
        return self._out.get("stdout", ""), self._out.get("stderr", "")

    def tail(self) -> str:
        return self.output()[1][-2000:]

    def phases(self, t_kill: float, victim: int | None, attempt: int) -> dict[str, float]:
        """Seconds from a kill at ``t_kill`` (``victim``: its pid, None for a fault that killed
        itself) to each of PHASES; ``attempt``: the torchrun start that was killed."""
        marks = read(str(self.trace_dir))
        old = {pid for pid, (first, last) in self.seen.items() if first <= t_kill <= last + 0.01}
        survivors = [pid for pid in old if pid != victim]
        seen_fail = [
            wall
            for (_, a), ms in marks.items()
            if a == attempt
            for name, wall, _ in ms
            if name.startswith(("peer lost", "signal received")) and wall >= t_kill
        ]
        out = {
            "noticed": min(seen_fail) - t_kill if seen_fail else None,
            "survivors gone": max(self.seen[p][1] for p in survivors) - t_kill if survivors else None,
        }
        new = [first for pid, (first, _) in self.seen.items() if first > t_kill]
        out["workers started"] = min(new) - t_kill if new else None
        for phase, name in _NEXT_START.items():
            times = [
                wall for (_, a), ms in marks.items() if a == attempt + 1 for n, wall, _ in ms if n == name
            ]
            out[phase] = max(times) - t_kill if times else None
        return out
