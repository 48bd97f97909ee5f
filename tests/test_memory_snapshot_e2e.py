"""Issue 13 items 3, 5, 6 through torchrun: a SIGKILLed worker, the restart resumes from /dev/shm
and finishes byte-identical; nothing is left in /dev/shm after a finished or a failed job.

The restart case is the snapshot run of benchmarks/recovery.py (the same torchrun job, kept with
--keep): one job proves the recovery claims here and that the benchmark runs and writes its JSON
(tests/test_benchmarks_run.py leaves recovery.py to this file)."""
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
RUN = ["dist.world_size=2", "train.steps=8", "train.global_batch=16", "checkpoint.every_steps=4",
       "checkpoint.resume=latest", "checkpoint.memory_every_steps=1", "fault.kill_rank=1", "fault.kill_at_step=6"]
# benchmarks/recovery.py runs RUN (with checkpoint.verify_resume=false, as tree() has it) under
# torchrun --max-restarts 1, once with snapshots and once without ("disk only").
BENCH = ["benchmarks/recovery.py", "--world-size", "2", "--steps", "8", "--kill-at", "6", "--every", "4",
         "--repeats", "1"]


def _torchrun(run_dir: Path, restarts: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", str(restarts),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "train.py", f"hydra.run.dir={run_dir}", *RUN]
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


@pytest.mark.slow
def test_torchrun_restart_resumes_from_memory_byte_identical_and_cleans_up(tmp_path):
    clean = train(tree(2, steps=8, every=4), tmp_path / "clean")
    assert all(r["error"] is None for r in clean)
    out = tmp_path / "recovery.json"
    proc = subprocess.run([sys.executable, *BENCH, "--out", str(out), "--keep", str(tmp_path / "runs")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-2500:]
    # The benchmark: kill after step 6, disk checkpoint at 4: snapshots lose nothing, disk only two steps.
    median = json.loads(out.read_text())["median"]
    assert median["snapshots"]["steps_lost"] == 0 and median["disk only"]["steps_lost"] == 2
    run = tmp_path / "runs" / "snapshots0"
    stdout, stderr = (run / "torchrun.stdout").read_text(), (run / "torchrun.stderr").read_text()
    assert "fault: rank 1 kills itself after step 6" in stderr
    assert "resume: from the memory snapshot of step 6" in stdout     # disk alone: step 4
    assert _files(run) == _files(tmp_path / "clean")
    assert not shm.job_dir(run).exists()          # removed by the finished run itself


@pytest.mark.slow
def test_a_failed_job_leaves_nothing_in_shared_memory(tmp_path):
    run = tmp_path / "failed"
    proc = _torchrun(run, restarts=0)             # the kill ends the job: no worker runs any cleanup
    assert proc.returncode != 0 and "fault: rank 1 kills itself after step 6" in proc.stderr
    assert "memory snapshot:" in proc.stdout      # snapshots were written
    assert _gone(shm.job_dir(run)), sorted(p.name for p in shm.job_dir(run).iterdir())
