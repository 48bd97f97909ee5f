"""What the launcher tells a worker through its environment, read in one place."""

from __future__ import annotations

import os


def attempt() -> int:
    """Which start of the job this is (0 = the first), the same on every node: train.py sets
    DISTLIB_ATTEMPT as the ranks agreed it (distlib/launch/torchrun.py join_job_start);
    torchrun's per-node restart count is the fallback, and 0 outside torchrun."""
    return int(os.environ.get("DISTLIB_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
