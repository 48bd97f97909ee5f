"""Helpers for end-to-end tests that run train.py / torchrun as real subprocesses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# The environment srun gives task 0 of a 2-task step: train.py then runs that rank itself
# (distlib/launch/slurm.py), as under torchrun.
SRUN_TASK = {
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_LOCALID": "0",
    "SLURM_JOB_ID": "123",
    "SLURM_JOB_NODELIST": "localhost",
    "SLURM_STEP_ID": "0",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repo root; never hangs past ``timeout``."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)


def train(run_dir: Path, *overrides: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python train.py` (self-launching its workers) with an explicit run directory, run in a
    fork of the test process (tests/forkrun.py: the same script, without 3-10 s of start-up)."""
    from forkrun import run_script

    return run_script("train.py", f"hydra.run.dir={run_dir}", *overrides, timeout=timeout)


def torchrun(
    run_dir: Path, *overrides: str, nproc: int = 4, timeout: float = 180, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N train.py` on a free port."""
    return run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
            *extra,
            "train.py",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ],
        timeout=timeout,
    )
