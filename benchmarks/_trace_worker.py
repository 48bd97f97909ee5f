"""Run train.py as one torchrun worker, recording when it reaches each phase (for startup.py).

    torchrun ... benchmarks/_trace_worker.py train.py [overrides]     # with DISTLIB_TRACE_DIR set

Imports torch and distlib (timing each), wraps the functions that bound its phases
(process-group init, Trainer construction, checkpoint save, the resume check, ...) so that each
call records a timestamp, and then runs train.py as ``__main__`` with runpy. train.py itself is
not modified. Each rank writes ``rank<R>.json``: (phase, wall clock, process CPU seconds) marks,
in order.
"""

from __future__ import annotations

import atexit
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
        self.trace_dir = trace_dir
        self.marks = [("process created", _process_started_at(), 0.0)]
        if trace_dir:
            atexit.register(self.write)

    @staticmethod
    def from_env() -> Marks:
        return Marks(os.environ.get("DISTLIB_TRACE_DIR"))

    def mark(self, phase: str) -> None:
        repeats = sum(1 for name, *_ in self.marks if name == phase or name.startswith(phase + " #"))
        self.marks.append((f"{phase} #{repeats + 1}" if repeats else phase, time.time(), time.process_time()))

    def write(self) -> None:
        self.mark("exit")
        rank = int(os.environ.get("RANK", "0"))
        os.makedirs(self.trace_dir, exist_ok=True)
        with open(os.path.join(self.trace_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "marks": self.marks}, f)


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


def main() -> None:
    marks = Marks.from_env()
    train_py = os.path.abspath(sys.argv[1])
    root = os.path.dirname(train_py)
    sys.path[0] = root
    import torch  # noqa: F401
    import torch.distributed as dist

    marks.mark("import torch")
    from distlib.app import summary, trainer
    from distlib.app.checkpointing import checkpointer
    from distlib.checkpoint import sharded as checkpoint

    marks.mark("import distlib")

    # Hydra is imported by train.main(), on rank 0 only under torchrun: it lands in the next phase.
    _wrap(dist, "init_process_group", marks, "config (Hydra / from rank 0)", "process group")
    _wrap(trainer.Trainer, "__init__", marks, None, "trainer built (corpus, model, opt)")
    _wrap(checkpoint, "save", marks, "checkpoint save starts", "checkpoint saved")
    _wrap(trainer, "memory_report", marks, "training loop done", None)
    _wrap(checkpointer.Checkpointer, "verify_resume", marks, None, "resume verified")
    _wrap(summary, "check_invariants", marks, "run returned", None)
    _wrap(dist, "destroy_process_group", marks, "report printed", "process group destroyed")

    import runpy

    sys.argv = sys.argv[1:]
    runpy.run_path(train_py, run_name="__main__")


if __name__ == "__main__":
    main()
