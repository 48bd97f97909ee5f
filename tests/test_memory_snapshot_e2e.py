"""Under torchrun, a SIGKILLed worker's restart resumes from the /dev/shm snapshots (or, without them,
from disk) and finishes byte-identical to an uninterrupted run, and no job leaves anything in /dev/shm.

The two restart runs are benchmarks/recovery.py's (kept with --keep), so its one run also checks that
the benchmark runs and writes its JSON (tests/test_benchmarks_run.py leaves recovery.py to this file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_util import train, tree

from distlib.checkpoint import memory_snapshot as shm
from distlib.checkpoint import sharded as checkpoint

ROOT = Path(__file__).resolve().parent.parent
RUN = [
    "dist.world_size=2",
    "train.steps=8",
    "train.global_batch=16",
    "checkpoint.every_steps=4",
    "checkpoint.resume=latest",
    "checkpoint.memory_every_steps=1",
    "fault.kill_rank=1",
    "fault.kill_at_step=6",
]
# benchmarks/recovery.py runs RUN (with checkpoint.verify_resume=false, as tree() has it) under
# torchrun --max-restarts 1, once with snapshots and once without ("disk only").
BENCH = [
    "benchmarks/recovery.py",
    "--world-size",
    "2",
    "--steps",
    "8",
    "--kill-at",
    "6",
    "--every",
    "4",
    "--repeats",
    "1",
    "--external",
    "0",
]


def _torchrun(run_dir: Path, restarts: int, run: list[str] = RUN) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        str(restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        "train.py",
        f"hydra.run.dir={run_dir}",
        *run,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def _files(run: Path) -> dict[str, bytes]:
    ckpt = run / "checkpoints" / checkpoint.step_dir_name(8)
    return {f["path"]: (ckpt / f["path"]).read_bytes() for f in checkpoint.verify(ckpt)["files"]}


def _gone(directory: Path, within_s: float = 10.0) -> bool:
    """The reaper polls the launcher every 0.2 s; give it time on a loaded machine."""
    deadline = time.monotonic() + within_s
    while directory.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not directory.exists()


@pytest.fixture(scope="module")
def recovery(tmp_path_factory) -> dict:
    """benchmarks/recovery.py on RUN, its two runs kept, and the uninterrupted run to compare with."""
    tmp = tmp_path_factory.mktemp("recovery")
    clean = train(tree(2, steps=8, every=4), tmp / "clean")
    assert all(r["error"] is None for r in clean)
    out = tmp / "recovery.json"
    proc = subprocess.run(
        [sys.executable, *BENCH, "--out", str(out), "--keep", str(tmp / "runs")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-2500:]
    return {
        "clean": tmp / "clean",
        "json": json.loads(out.read_text()),
        "snapshots": tmp / "runs" / "snapshots0",
        "disk only": tmp / "runs" / "disk_only0",
    }


def _output(run: Path) -> tuple[str, str]:
    return (run / "torchrun.stdout").read_text(), (run / "torchrun.stderr").read_text()


@pytest.mark.slow
def test_torchrun_restart_resumes_from_memory_byte_identical_and_cleans_up(recovery):
    # The benchmark: kill after step 6, disk checkpoint at 4: snapshots lose nothing, disk only two steps.
    median = recovery["json"]["median"]
    assert median["snapshots"]["steps_lost"] == 0 and median["disk only"]["steps_lost"] == 2
    run = recovery["snapshots"]
    stdout, stderr = _output(run)
    assert "fault: rank 1 kills itself after step 6" in stderr
    assert "resume: from the memory snapshot of step 6" in stdout  # disk alone: step 4
    assert _files(run) == _files(recovery["clean"])
    assert not shm.job_dir(run).exists()  # removed by the finished run itself


@pytest.mark.slow
def test_a_crash_inside_a_save_resumes_from_that_steps_snapshot(recovery, tmp_path):
    """The snapshot of a step is taken before its disk save (Checkpointer.boundary): every rank
    dying half-way through writing the step-4 checkpoint restarts from step 4's snapshot, not
    step 3's, so no step is redone; the final checkpoint is the uninterrupted run's."""
    run = tmp_path / "run"
    crash = [a for a in RUN if not a.startswith("fault.")]
    crash += ["fault.crash_in_save=mid_shard", "fault.save_fault_step=4", "checkpoint.verify_resume=false"]
    proc = _torchrun(run, restarts=1, run=crash)
    assert proc.returncode == 0, proc.stderr[-2500:]
    assert "dies in the step-4 save at mid_shard" in proc.stderr
    assert "resume: from the memory snapshot of step 4" in proc.stdout, proc.stdout[-2000:]
    assert _files(run) == _files(recovery["clean"])


@pytest.mark.slow
def test_torchrun_restart_without_snapshots_resumes_from_disk_and_finishes_byte_identical(recovery):
    """docs/checkpoints.md "torchrun restarts": every rank resumes from the newest valid checkpoint
    and the final checkpoint is byte-identical to an uninterrupted run's (every shard compared)."""
    run = recovery["disk only"]
    stdout, stderr = _output(run)
    assert "fault: rank 1 kills itself after step 6" in stderr
    assert f"resumed from {run / 'checkpoints' / 'step_00000004'} at step 4" in stdout
    assert "memory snapshot" not in stdout
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics if m["type"] == "step"]  # (events are logged too)
    # The first attempt logged steps 1..5 (rank 1 took part in step 6, so rank 0 finished step 5),
    # the second went on from the step-4 checkpoint: steps 5..8 were logged again.
    assert steps[:5] == [1, 2, 3, 4, 5] and steps[-4:] == [5, 6, 7, 8] and steps.count(5) == 2, steps
    expected, got = _final_files(recovery["clean"]), _final_files(run)
    assert sorted(got) == sorted(expected) == [checkpoint.shard_name(r) for r in range(2)]
    for name in expected:
        assert got[name][:2] == expected[name][:2], f"{name}: size/sha256 differ"
        assert got[name][2] == expected[name][2], f"{name}: bytes differ"


def _final_files(run: Path) -> dict[str, tuple[int, str, bytes]]:
    ckpt = run / "checkpoints" / checkpoint.step_dir_name(8)
    manifest = checkpoint.verify(ckpt)
    return {f["path"]: (f["bytes"], f["sha256"], (ckpt / f["path"]).read_bytes()) for f in manifest["files"]}


@pytest.mark.slow
def test_a_restart_resumes_by_itself_when_checkpoint_resume_was_not_given(recovery, tmp_path):
    """--max-restarts without checkpoint.resume=latest: the restart continues the job's own
    checkpoints (before, it refused to start over them and the job exited 1)."""
    run = tmp_path / "run"
    proc = _torchrun(run, restarts=1, run=[a for a in RUN if a != "checkpoint.resume=latest"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = "restart 1 of the job: checkpoint.resume was not set, so it resumes from the latest checkpoint"
    assert proc.stdout.count(said) == 1, proc.stdout[-3000:]  # rank 0's line, once
    assert "resume: from the memory snapshot of step 6" in proc.stdout
    assert _files(run) == _files(recovery["clean"])


@pytest.mark.slow
def test_a_failed_job_leaves_nothing_in_shared_memory(tmp_path):
    run = tmp_path / "failed"
    proc = _torchrun(run, restarts=0)  # the kill ends the job: no worker runs any cleanup
    assert proc.returncode != 0 and "fault: rank 1 kills itself after step 6" in proc.stderr
    assert "memory snapshot:" in proc.stdout  # snapshots were written
    assert _gone(shm.job_dir(run)), sorted(p.name for p in shm.job_dir(run).iterdir())


def _files_at(run: Path, step: int) -> dict[str, bytes]:
    ckpt = run / "checkpoints" / checkpoint.step_dir_name(step)
    return {f["path"]: (ckpt / f["path"]).read_bytes() for f in checkpoint.verify(ckpt)["files"]}


@pytest.fixture(scope="module")
def begun(tmp_path_factory) -> dict:
    """A checkpoint of step 4 another run saved, and a run of 12 steps that began from it uninterrupted."""
    tmp = tmp_path_factory.mktemp("begun")
    assert all(r["error"] is None for r in train(tree(2, steps=4, every=4), tmp / "before"))
    start = tmp / "before" / "checkpoints" / checkpoint.step_dir_name(4)
    clean = train(tree(2, steps=12, every=4, checkpoint={"resume": str(start)}), tmp / "clean")
    assert all(r["error"] is None and r["start"] == 4 for r in clean)
    return {"start": start, "clean": tmp / "clean"}


@pytest.mark.slow
def test_a_restart_of_a_job_begun_from_a_checkpoint_continues_its_own_steps(begun, tmp_path):
    """checkpoint.resume=<path>: a restart continues from the job's own memory snapshot of the step
    the kill ended, not from <path> again (which redid every step since and overwrote nothing
    newer); the final checkpoint is the uninterrupted run's, byte for byte."""
    run = tmp_path / "run"
    argv = ["dist.world_size=2", "train.steps=12", "train.global_batch=16", "checkpoint.every_steps=4"]
    argv += [f"checkpoint.resume={begun['start']}", "checkpoint.memory_every_steps=1"]
    proc = _torchrun(run, restarts=1, run=[*argv, "fault.kill_rank=1", "fault.kill_at_step=10"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "fault: rank 1 kills itself after step 10" in proc.stderr
    assert "resume: from the memory snapshot of step 10" in proc.stdout, proc.stdout[-3000:]
    assert _files_at(run, 12) == _files_at(begun["clean"], 12)


def test_without_snapshots_a_restart_continues_from_the_jobs_newest_checkpoint(begun, tmp_path, monkeypatch):
    """The same on disk: a restart (DISTLIB_ATTEMPT=1, as train.py's ranks agree it) of a job begun
    from <path> that saved step 8 starts at step 8 and says so; with nothing saved yet it begins from
    <path> again."""
    run, resume = tmp_path / "run", {"resume": str(begun["start"])}
    first = train(tree(2, steps=8, every=4, checkpoint=resume), run)  # the first start saved step 8
    assert [r["start"] for r in first] == [4, 4]
    monkeypatch.setenv("DISTLIB_ATTEMPT", "1")
    again = train(tree(2, steps=12, every=4, checkpoint=resume), run)
    assert [r["start"] for r in again] == [8, 8]
    assert _files_at(run, 12) == _files_at(begun["clean"], 12)
    fresh = train(tree(2, steps=8, every=4, checkpoint=resume), tmp_path / "nothing saved")
    assert [r["start"] for r in fresh] == [4, 4]
