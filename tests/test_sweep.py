"""`python train.py -m dist.world_size=...`: each job trains, and the sweep ends with the table
comparing every job's loss trajectory with world size 1 (distlib/launch/sweep_table.py, a Hydra
callback); the test computes the invariance itself from each job's own metrics.jsonl."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ckpt_util import assert_files_match_manifest

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-5  # fp32 losses at a fixed global batch, per step, relative to world size 1's


def _jobs(sweep: Path) -> dict[tuple[int, int], list[float]]:
    """(world size, ZeRO stage) -> the job's losses by step, read from its own config and metrics."""
    jobs = {}
    for config in sweep.glob("*/.hydra/config.yaml"):
        cfg, job = yaml.safe_load(config.read_text()), config.parents[1]
        records = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        steps = {r["step"]: float.fromhex(r["loss_hex"]) for r in records if r["type"] == "step"}
        jobs[cfg["dist"]["world_size"], cfg["zero"]["stage"]] = [steps[k] for k in sorted(steps)]
        assert_files_match_manifest(job / "checkpoints" / "step_00000002")
    return jobs


def _max_rel_diff(losses: list[float], reference: list[float]) -> float:
    assert len(losses) == len(reference)
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


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
    losses = _jobs(tmp_path)
    assert sorted(losses) == [(1, 2), (1, 3), (2, 2), (2, 3)] and all(len(v) == 3 for v in losses.values())
    ours = {stage: _max_rel_diff(losses[2, stage], losses[1, stage]) for stage in (2, 3)}
    assert all(d <= RTOL for d in ours.values()), f"relative loss difference to world size 1 by stage: {ours}"
    # the table reports the same numbers, from the same losses
    jobs = json.loads((tmp_path / "comparison.json").read_text())
    assert sorted((j["world_size"], j["stage"]) for j in jobs) == sorted(losses)
    for job in jobs:
        assert job["losses"] == losses[job["world_size"], job["stage"]], job
        assert job["max_rel_diff"] == (ours[job["stage"]] if job["world_size"] == 2 else 0.0), job
        assert job["optimizer_bytes"] == 12 * -(-30144 // job["world_size"])  # 12P/N, P = 30144
    assert "world-size invariance (2 fp32 job(s) vs world size 1)" in proc.stdout
    assert ": OK" in proc.stdout.splitlines()[-1]


def _job(root: Path, name: str, overrides: list[str], losses: list[float]) -> Path:
    """A finished job's directory as Hydra and the trainer leave it: .hydra/config.yaml, metrics.jsonl."""
    from distlib.launch.hydra_config import compose_tree

    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(compose_tree(overrides)))
    rows = [{"type": "step", "step": s, "loss": loss, "step_time_s": 0.1} for s, loss in enumerate(losses, 1)]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return job


def test_the_table_counts_a_context_parallel_jobs_global_batch_by_its_data_parallel_ranks(tmp_path):
    """train.global_batch=null: a job's global batch is batch_size x dp x grad_accum, where dp is what
    the layout leaves after tp, pp and cp; dist.cp=2 over 2 ranks is one data-parallel rank, the same
    batch as world size 1, so it is compared with it."""
    from distlib.launch import sweep_table

    per_rank = ["train.global_batch=null", "train.batch_size=2"]
    one = _job(tmp_path, "0", ["dist.world_size=1", *per_rank], [3.0, 2.0])
    cp = _job(tmp_path, "1", ["dist.world_size=2", "dist.cp=2", *per_rank], [3.0, 2.5])
    dp = _job(tmp_path, "2", ["dist.world_size=2", *per_rank], [3.0, 2.0])
    jobs = sweep_table.compare([sweep_table.read_job(j) for j in (one, cp, dp)])
    assert [j["global_batch"] for j in jobs] == [2, 2, 4]
    assert jobs[1]["max_rel_diff"] == 0.25  # against world size 1
    assert jobs[2]["max_rel_diff"] is None  # twice the batch: nothing to compare with
