"""What the launcher tells a worker through its environment, read in one place."""

from __future__ import annotations

import os


def attempt() -> int:
    """Which start of the job this is (0 = the first), the same on every node: train.py sets
    DISTLIB_ATTEMPT as the ranks agreed it (distlib/launch/torchrun.py join_job_start);
    torchrun's per-node restart count is the fallback, and 0 outside torchrun."""
    return int(os.environ.get("DISTLIB_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def under_agent() -> bool:
    """Whether an agent started this worker: torch's (torchrun, or python train.py's by default),
    which sets TORCHELASTIC_RUN_ID, or python train.py's own for dist.max_restarts
    (distlib/launch/agent.py), which sets DISTLIB_GENERATION."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "DISTLIB_GENERATION" in os.environ
