"""`python train.py -m dist.world_size=...`: each job trains, and the sweep ends with the table
comparing every job's loss trajectory with world size 1 (distlib/sweep_report.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_world_size_sweep_is_invariant_for_zero_2_and_3(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "-m",
            "dist.world_size=1,2",
            "zero.stage=2,3",
            "train.global_batch=16",
            "train.steps=3",
            "checkpoint.every_steps=2",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("RESUME VERIFIED") == 4  # each job saved at step 2 and reloaded it
    jobs = json.loads((tmp_path / "comparison.json").read_text())
    assert sorted((j["world_size"], j["stage"]) for j in jobs) == [(1, 2), (1, 3), (2, 2), (2, 3)]
    for job in jobs:
        assert len(job["losses"]) == 3
        assert job["max_rel_diff"] is not None and job["max_rel_diff"] <= 1e-5, job
        assert job["optimizer_bytes"] == 12 * -(-30144 // job["world_size"])  # 12P/N, P = 30144
    assert "world-size invariance (2 fp32 job(s) vs world size 1)" in proc.stdout
    assert ": OK" in proc.stdout.splitlines()[-1]
