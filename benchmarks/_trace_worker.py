"""Run train.py as one torchrun worker, recording when it reaches each phase (startup.py, recovery.py).

    torchrun ... benchmarks/_trace_worker.py train.py [overrides]     # with DISTLIB_TRACE_DIR set

Imports torch and distlib (timing each), wraps the functions that bound its phases
(process-group init, Trainer construction, the resume, the first step, checkpoint saves, a failed
collective, the exit, ...) so that each call records a timestamp, and then runs train.py as
``__main__`` with runpy. train.py itself is not modified. Each mark is appended at once (a worker
that is killed or leaves with os._exit keeps what it marked) to ``rank<R>-a<A>.jsonl`` (A: the
torchrun restart), one JSON line per mark: [phase, wall clock, process CPU seconds].
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time


def _process_started_at() -> float:
    """Wall-clock time at which this process was created (10 ms resolution, from /proc)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class Marks:
    def __init__(self, trace_dir: str | None):
        self.trace_dir, self.names = trace_dir, []
        rank, attempt = os.environ.get("RANK", "0"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.path = os.path.join(trace_dir, f"rank{rank}-a{attempt}.jsonl") if trace_dir else None
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            self._append("process created", _process_started_at(), 0.0)
            atexit.register(self.mark, "exit")

    @staticmethod
    def from_env() -> Marks:
        return Marks(os.environ.get("DISTLIB_TRACE_DIR"))

    def _append(self, name: str, wall: float, cpu: float) -> None:
        self.names.append(name)
        with open(self.path, "a") as f:
            f.write(json.dumps([name, wall, cpu]) + "\n")

    def mark(self, phase: str) -> None:
        if not self.path:
            return
        repeats = sum(1 for name in self.names if name == phase or name.startswith(phase + " #"))
        self._append(f"{phase} #{repeats + 1}" if repeats else phase, time.time(), time.process_time())


def compile_distlib(root: str) -> None:
    """Cache distlib's compiled modules, as any interpreter does at its first import, unless
    PYTHONDONTWRITEBYTECODE is set (it is on these machines: then every worker compiled all 112
    modules, ~0.2 s of CPU each, and the benchmarks timed the compiler). ``make bytecode`` does the
    same; a module already cached is skipped."""
    import compileall

    compileall.compile_dir(os.path.join(root, "distlib"), quiet=1)


def read(trace_dir: str) -> dict[tuple[int, int], list[tuple[str, float, float]]]:
    """(rank, attempt) -> that worker's marks, in order."""
    out = {}
    for name in sorted(os.listdir(trace_dir)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            rank, attempt = name[len("rank") : -len(".jsonl")].split("-a")
            with open(os.path.join(trace_dir, name)) as f:
                out[int(rank), int(attempt)] = [tuple(json.loads(line)) for line in f if line.strip()]
    return out


def _wrap(owner, name: str, marks: Marks, before: str | None, after: str | None) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before:
            marks.mark(before)
        try:
            return original(*args, **kwargs)
        finally:
            if after:
                marks.mark(after)

    setattr(owner, name, wrapper)


def _once(owner, name: str, marks: Marks, after: str) -> None:
    """Mark ``after`` when the first call of owner.name returns."""
    original = getattr(owner, name)
    done = []

    def wrapper(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            if not done:
                done.append(True)
                marks.mark(after)

    setattr(owner, name, wrapper)


def main() -> None:
    marks = Marks.from_env()
    train_py = os.path.abspath(sys.argv[1])
    root = os.path.dirname(train_py)
    sys.path[0] = root
    gc.disable()  # train.py pauses the collector for its imports, done here on its behalf
    import torch  # noqa: F401
    import torch.distributed as dist

    marks.mark("import torch")
    from distlib.app import trainer
    from distlib.app.checkpointing import checkpointer
    from distlib.app.observe import summary
    from distlib.app.runtime import faults
    from distlib.app.unattended import stopping
    from distlib.checkpoint import sharded as checkpoint
    from distlib.comm import watchdog
    from distlib.launch import hydra_config, local, run_lock, worker  # noqa: F401 - train.py's imports

    marks.mark("import distlib")

    # Hydra is imported by train.main(), on rank 0 only under torchrun: it lands in the next phase.
    _wrap(dist, "init_process_group", marks, "config (Hydra / from rank 0)", "process group")
    _wrap(trainer.Trainer, "__init__", marks, None, "trainer built (corpus, model, opt)")
    _wrap(checkpointer.Checkpointer, "resume", marks, None, "state restored")
    _once(trainer.Trainer, "_step", marks, "first step")
    _wrap(checkpoint, "save", marks, "checkpoint save starts", "checkpoint saved")
    _wrap(trainer, "memory_report", marks, "training loop done", None)
    _wrap(checkpointer.Checkpointer, "verify_resume", marks, None, "resume verified")
    _wrap(summary, "check_invariants", marks, "run returned", None)
    _wrap(dist, "destroy_process_group", marks, "report printed", "process group destroyed")
    # what a failure looks like from inside: a peer lost, the launcher's signal, the exit
    _wrap(watchdog, "diagnose", marks, "peer lost", None)
    _wrap(stopping.StopSignals, "_handle", marks, "signal received", None)
    _wrap(worker, "leave", marks, "leaving", None)
    _wrap(faults, "kill_self", marks, "killing itself", None)

    import runpy

    sys.argv = sys.argv[1:]
    runpy.run_path(train_py, run_name="__main__")


if __name__ == "__main__":
    main()
