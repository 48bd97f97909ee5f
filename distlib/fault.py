"""Fault injection (``conf/fault/``): the failures the recovery paths exist for, on demand.

Tests and drills use it to prove what happens when a worker dies mid-run, a
process dies at a given point of a checkpoint save, or the disk fills up.
Under torchrun a kill fires only on the first attempt
(``TORCHELASTIC_RESTART_COUNT`` is 0), so the restarted group runs clean, as
it would after a real one-off failure.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path

from distlib.checkpoint import SaveHook
from distlib.config import FaultConfig

# fault.crash_in_save value -> the checkpoint.save hook point where the process dies
_CRASH_POINTS = {"mid_shard": "shard_written", "before_manifest": "shards_written",
                 "before_commit": "manifest_written", "after_commit": "committed"}


def first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def kill_self() -> None:
    """Die the way an OOM kill or a lost node does: no cleanup, no exception handlers."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


class Faults:
    def __init__(self, cfg: FaultConfig, rank: int):
        self.cfg, self.rank = cfg, rank
        self.saves = 0

    def after_step(self, step: int) -> None:
        if self.cfg.kill_rank == self.rank and self.cfg.kill_at_step == step and first_attempt():
            print(f"fault: rank {self.rank} kills itself after step {step}", file=sys.stderr)
            kill_self()

    def save_hook(self, step: int) -> SaveHook | None:
        """The hook for the save of ``step`` (None: no fault in this save)."""
        self.saves += 1
        target = self.cfg.save_fault_step
        if not first_attempt() or (step != target if target is not None else self.saves != 1):
            return None
        crash_at = _CRASH_POINTS.get(self.cfg.crash_in_save or "")
        disk_full = self.cfg.disk_full_rank == self.rank

        def hook(point: str, path: Path) -> None:
            if point == "shard_written" and (disk_full or crash_at == point):
                _truncate_to_half(path)  # what a full disk or a crash mid-write leaves behind
            if disk_full and point == "shard_written":
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by fault.disk_full_rank)")
            if point == crash_at:
                print(f"fault: rank {self.rank} dies in the step-{step} save at {self.cfg.crash_in_save}",
                      file=sys.stderr)
                kill_self()

        return hook if (crash_at or disk_full) else None
