"""Checkpoints through train.py: a damaged or mismatched checkpoint and a full disk end the run with
one clear error line, and a run that crashed in a save resumes from the newest committed checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_util import train, tree
from forkrun import run_script

from distlib.app.config.run import ConfigError, RunConfig
from distlib.checkpoint import sharded as checkpoint

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["dist.world_size=2", "train.steps=6", "checkpoint.every_steps=3", "train.global_batch=16"]


def _train(run_dir: Path, *overrides: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`python [launcher] train.py ...`; without a launcher in a fork of this process (tests/forkrun.py)."""
    if not launcher:
        return run_script(
            "train.py", f"hydra.run.dir={run_dir}", *overrides, env={"OMP_NUM_THREADS": "1"}, timeout=300
        )
    cmd = [sys.executable, *launcher, "train.py", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: checkpoint")]


def test_fault_options_are_validated():
    with pytest.raises(ConfigError, match="fault.crash_in_save must be null or one of"):
        RunConfig.from_dict({"fault": {"crash_in_save": "sometime"}})
    with pytest.raises(ConfigError, match="must be set together"):
        RunConfig.from_dict({"fault": {"kill_rank": 1}})
    with pytest.raises(ConfigError, match="fault.kill_rank=4 is not a rank"):
        RunConfig.from_dict({"fault": {"kill_rank": 4, "kill_at_step": 2}})
    with pytest.raises(ConfigError, match="checkpoint.keep_last must be an integer >= 0"):
        RunConfig.from_dict({"checkpoint": {"keep_last": -1}})


@pytest.mark.slow
def test_load_errors_reach_the_user_as_one_clear_line(tmp_path):
    run = tmp_path / "run"
    assert all(r["error"] is None for r in train(tree(2), run))  # 2-rank checkpoints at steps 3 and 6
    root = run / "checkpoints"
    shard = root / "step_00000006" / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    one_rank = [
        arg.replace("dist.world_size=2", "dist.world_size=1") for arg in SMALL
    ]  # loads reshard 2 -> 1

    damaged = _train(run, *one_rank, f"checkpoint.resume={root / 'step_00000006'}")
    assert damaged.returncode == 1
    lines = _error_lines(damaged.stderr)
    assert len(lines) == 1, damaged.stderr
    assert str(root / "step_00000006") in lines[0] and "rank00001.safetensors has sha256" in lines[0]
    assert "Traceback" not in damaged.stderr

    mismatch = _train(
        tmp_path / "other", *one_rank, "model.dim=64", f"checkpoint.resume={root / 'step_00000003'}"
    )
    assert mismatch.returncode == 1 and "Traceback" not in mismatch.stderr
    assert len(_error_lines(mismatch.stderr)) == 1
    assert "model.dim: checkpoint 32, this run 64" in mismatch.stderr
    assert "parameter tok_emb.weight: checkpoint 64x32, model 64x64" in mismatch.stderr

    fallback = _train(run, *one_rank, "checkpoint.resume=latest")
    assert fallback.returncode == 0, fallback.stderr
    assert "skipping a damaged checkpoint" in fallback.stderr and "rank00001.safetensors" in fallback.stderr
    assert f"resumed from {root / 'step_00000003'} at step 3" in fallback.stdout


@pytest.mark.slow
def test_crash_before_manifest_then_resume_latest(tmp_path):
    crashed = _train(tmp_path, *SMALL, "fault.crash_in_save=before_manifest", "fault.save_fault_step=6")
    assert crashed.returncode != 0
    assert "dies in the step-6 save at before_manifest" in crashed.stderr
    assert [p.name for p in checkpoint.list_committed(tmp_path / "checkpoints")] == ["step_00000003"]
    resumed = _train(tmp_path, *SMALL, "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_00000003'} at step 3" in resumed.stdout
    checkpoint.verify(tmp_path / "checkpoints" / "step_00000006")


@pytest.mark.slow
def test_full_disk_fails_the_run_loudly(tmp_path):
    full = _train(tmp_path, *SMALL, "fault.disk_full_rank=1")
    assert full.returncode == 1 and "Traceback" not in full.stderr
    lines = _error_lines(full.stderr)
    assert len(lines) == 1 and "checkpoint save of step 3 failed, nothing committed: rank 1" in lines[0]
    assert "No space left on device" in lines[0]
    assert checkpoint.list_committed(tmp_path / "checkpoints") == []
    assert not any((tmp_path / "checkpoints").iterdir())


# The torchrun restart from disk (every rank resumes from the newest valid checkpoint, the final
# checkpoint byte-identical to an uninterrupted run's) is checked on the disk-only run of
# benchmarks/recovery.py: tests/test_memory_snapshot_e2e.py::
# test_torchrun_restart_without_snapshots_resumes_from_disk_and_finishes_byte_identical.
