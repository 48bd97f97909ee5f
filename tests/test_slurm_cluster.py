"""SLURM for real: a private local cluster (scripts/slurm_local.sh: munged, slurmctld, slurmd in a
temporary directory, on free ports) runs scripts/train.sbatch and the submitit sweep.

Skipped, with the reason, where SLURM is not installed (`apt-get install slurm-wlm munge`; .ci/run
installs it) or the shell is not root. One cluster serves the module; it is stopped at the end and
the test checks that its daemons are gone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e import ROOT
from forkrun import run_script

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "scripts" / "slurm_local.sh"
STEPS = 30  # long enough (> 3 s of training) that a signal sent at step 2 lands mid-run
DONE = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.env = {
            **os.environ,
            "SLURM_CONF": str(root / "slurm.conf"),
            "PYTHON": sys.executable,
            "PYTHONUNBUFFERED": "1",
        }

    def cmd(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        proc = subprocess.run(args, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc.stdout

    def sbatch(
        self, run_dir: Path, *args: str, options: tuple[str, ...] = (), script: str = "scripts/train.sbatch"
    ) -> tuple[str, Path]:
        """Submit `script` with RUN_DIR=run_dir; returns (job id, output file)."""
        out = run_dir.parent / f"{run_dir.name}.out"
        self.env["RUN_DIR"] = str(run_dir)
        job = self.cmd("sbatch", "--parsable", f"--output={out}", *options, script, *args).strip()
        return job, out

    def job(self, job: str) -> dict[str, str]:
        text = self.cmd("scontrol", "show", "job", "-o", job)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job: str, timeout: float = 120) -> dict[str, str]:
        """Poll until the job has ended (sbatch --wait polls every 2-32 s). A requeue happens while the
        job runs (RUNNING -> PENDING), so an ended job stays ended."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job)
            if info["JobState"] in DONE:
                return info
            time.sleep(0.2)
        raise AssertionError(f"job {job} not done within {timeout}s: {self.job(job)}")


def _pids(root: Path) -> list[int]:
    return [int((root / "run" / f"{d}.pid").read_text()) for d in ("munged", "slurmctld", "slurmd")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("slurmctld") is None and not Path("/usr/sbin/slurmctld").exists():
        pytest.skip("SLURM is not installed (no slurmctld): apt-get install slurm-wlm munge (.ci/run does)")
    root = tmp_path_factory.mktemp("slurm")
    start = subprocess.run(
        ["bash", str(SCRIPT), "start", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if start.returncode == 77:
        pytest.skip(start.stderr.strip())
    assert start.returncode == 0, start.stdout + start.stderr
    pids = _pids(root)
    try:
        yield Cluster(root)
    finally:
        stop = subprocess.run(
            ["bash", str(SCRIPT), "stop", str(root)], capture_output=True, text=True, timeout=120
        )
        assert stop.returncode == 0, stop.stdout + stop.stderr
        alive = [p for p in pids if Path(f"/proc/{p}").exists()]
        assert not alive, f"daemons still running after stop: {alive}"


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _wait_for_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r.get("type") == "step" and r["step"] >= step for r in _metrics(run_dir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"{run_dir} never reached step {step}")


def _committed(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step_*"))


def _verify(path: Path) -> None:
    proc = run_script("scripts/ckpt.py", "verify", str(path))
    assert proc.returncode == 0, f"{path}: {proc.stdout}{proc.stderr}"


def _same_final_checkpoint(reference: Path, run_dir: Path) -> None:
    proc = run_script(
        "scripts/compare_runs.py", str(reference), str(run_dir), "--checkpoint-step", str(STEPS)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"step-{STEPS} checkpoints are byte-identical" in proc.stdout


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """`sbatch scripts/train.sbatch` (4 srun tasks, uninterrupted): the batch-job test's run, and the
    run the interrupted ones must match byte for byte."""
    run_dir = tmp_path_factory.mktemp("jobs") / "reference"
    job, out = cluster.sbatch(run_dir, f"train.steps={STEPS}")
    info = cluster.wait(job)
    return job, info, run_dir, out


def test_cluster_is_up_with_this_machines_cpus(cluster):
    status = subprocess.run(
        ["bash", str(SCRIPT), "status", str(cluster.root)], capture_output=True, text=True, timeout=30
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.search(r"local\*\s+up\s+infinite\s+1\s+(idle|mixed|allocated)", status.stdout), status.stdout
    node = cluster.cmd("scontrol", "show", "node", "-o")
    assert f"CPUTot={os.cpu_count()}" in node


def test_batch_job_runs_one_srun_task_per_rank_and_ends_in_resume_verified(cluster, reference):
    job, info, run_dir, out = reference
    text = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert info["NumTasks"] == "4"
    assert text.rstrip().endswith("RESUME VERIFIED"), text[-2000:]
    assert f"job {job} (start 1): 4 ranks on" in text
    # four processes formed the group: one shard per rank in every checkpoint
    manifest = json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and len(manifest["files"]) == 4
    # the ranks were srun's tasks, not torchrun's or our launcher's workers: no torchelastic in the job
    assert (
        "torchelastic" not in text.lower()
        and "TORCHELASTIC" not in (run_dir / ".hydra" / "config.yaml").read_text()
    )
    # no task wrote a job log (conf/config.yaml: hydra/job_logging=none; the run's log is metrics.jsonl)
    assert not [p.name for p in run_dir.iterdir() if p.suffix == ".log"]


def test_torchrun_per_node_variant_runs_4_ranks_under_one_srun_task(cluster, tmp_path):
    """scripts/train_torchrun.sbatch on the one local node (several nodes are the same command with
    --nodes=N; the cross-host rendezvous itself is tested in tests/test_multinode.py)."""
    run_dir = tmp_path / "torchrun"
    job, out = cluster.sbatch(
        run_dir, "train.steps=2", "checkpoint.every_steps=2", script="scripts/train_torchrun.sbatch"
    )
    info = cluster.wait(job)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert info["NumTasks"] == "1"
    assert text.rstrip().endswith("RESUME VERIFIED"), text[-2000:]
    manifest = json.loads((run_dir / "checkpoints" / "step_00000002" / "manifest.json").read_text())
    assert manifest["world_size"] == 4


def test_usr2_saves_and_the_requeued_job_finishes_byte_identical(cluster, reference, tmp_path):
    run_dir = tmp_path / "preempted"
    job, out = cluster.sbatch(
        run_dir, f"train.steps={STEPS}", options=("--signal=USR2@60", "--requeue", "--open-mode=append")
    )
    _wait_for_step(run_dir, 2)
    cluster.cmd("scancel", "--signal=USR2", job)  # what SLURM sends 60 s before the time limit
    info = cluster.wait(job)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", text
    stopped = re.search(r"stopped by SIGUSR2 after step (\d+): checkpoint saved", text)
    assert stopped and 2 <= int(stopped.group(1)) < STEPS, text
    step = int(stopped.group(1))
    assert f"job {job}: stopped by SIGUSR2 with a checkpoint saved; requeueing" in text
    assert f"job {job} (start 2)" in text
    assert f"resume: latest valid checkpoint is {run_dir}/checkpoints/step_{step:08d}" in text
    assert text.rstrip().endswith("RESUME VERIFIED")
    _same_final_checkpoint(reference[2], run_dir)


def test_scancel_stops_at_a_step_boundary_with_a_committed_checkpoint(cluster, tmp_path):
    """Plain `scancel`: SIGTERM to every rank, which save and exit before KillWait's SIGKILL; the job
    ends CANCELLED and is not requeued (2 ranks: the cheapest job that has collectives)."""
    run_dir = tmp_path / "cancelled"
    job, out = cluster.sbatch(
        run_dir, f"train.steps={STEPS}", "checkpoint.every_steps=0", options=("--ntasks=2",)
    )
    _wait_for_step(run_dir, 2)
    cluster.cmd("scancel", job)
    info = cluster.wait(job)
    text = out.read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", text
    stopped = re.search(r"stopped by SIGTERM after step (\d+): checkpoint saved", text)
    assert stopped, text
    assert [p.name for p in _committed(run_dir)] == [f"step_{int(stopped.group(1)):08d}"]
    _verify(_committed(run_dir)[0])
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]


def _rank_pids(run_dir: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[1] == b"train.py" and f"hydra.run.dir={run_dir}".encode() in argv:
            found.append(int(proc.name))
    return found


def _all_stopped(pids: list[int], timeout: float = 10) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = []
        for pid in pids:
            try:
                states.append(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
            except OSError:
                states.append("gone")
        if all(s in ("T", "t") for s in states):
            return True
        time.sleep(0.01)
    return False


def test_a_kill_mid_save_leaves_nothing_that_resume_trusts(cluster, reference, tmp_path):
    """The worst moment for the SIGKILL that ends a cancelled job (scancel's, KillWait seconds after
    its SIGTERM, or `scancel --signal=KILL`) is during a save. Slurm cannot be aimed at it from
    outside: it sends SIGCONT first and SIGKILL ~0.3 s later (measured here), by when the save has
    committed. So the test freezes the job's ranks itself (SIGSTOP, root on the node) until it catches
    them with a half-written `.step_X.partial/`, SIGKILLs them there, then `scancel`s the job. Every
    committed checkpoint still verifies, and `checkpoint.resume=latest` continues from the newest
    committed one (never the partial) to a final checkpoint byte-identical to the uninterrupted run's."""
    run_dir = tmp_path / "killed"
    ckpts = run_dir / "checkpoints"
    job, out = cluster.sbatch(run_dir, f"train.steps={STEPS}", "checkpoint.every_steps=1")
    _wait_for_step(run_dir, 2)
    pids = _rank_pids(run_dir)
    assert len(pids) == 4, pids
    for _attempt in range(200):
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        assert _all_stopped(pids), "the ranks did not stop"
        partial = [p for p in ckpts.iterdir() if p.name.startswith(".")]
        if partial:
            break
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)
    else:
        pytest.fail("never caught a save in progress in 200 tries")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    cluster.cmd("scancel", job)
    info = cluster.wait(job)
    assert info["JobState"] in ("CANCELLED", "FAILED"), info
    assert partial[0].exists(), "the half-written checkpoint is still there"
    committed = _committed(run_dir)
    newest = int(committed[-1].name.split("_")[1])
    assert partial[0].name == f".step_{newest + 1:08d}.partial"
    for path in committed:
        _verify(path)
    # A later run with resume=latest (here outside SLURM: the checkpoint is not tied to the job).
    proc = run_script(
        "train.py",
        f"hydra.run.dir={run_dir}",
        "checkpoint.resume=latest",
        f"train.steps={STEPS}",
        "checkpoint.every_steps=10",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resume: latest valid checkpoint is {committed[-1]}" in proc.stdout + proc.stderr
    assert f"resumed from {committed[-1]} at step {newest}" in proc.stdout
    _same_final_checkpoint(reference[2], run_dir)


def _submitit_installed() -> bool:
    try:
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(
    not _submitit_installed(),
    reason="the optional `slurm` extra is not installed: pip install -e '.[slurm]' (.ci/run does)",
)
def test_hydra_sweep_runs_one_slurm_job_per_world_size(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "-m",
            "hydra/launcher=submitit_slurm",
            "dist.world_size=1,2,4",
            "train.steps=3",
            "checkpoint.every_steps=0",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=ROOT,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("sweep comparison") :]
    rows = re.findall(r"^(\d_ws(\d)_zero1)\s+(\d)\s", table, re.M)
    assert [(ws, col) for _, ws, col in rows] == [("1", "1"), ("2", "2"), ("4", "4")], table
    assert "world-size invariance" in table and ": OK" in table
    # three SLURM jobs (one array of three tasks), all completed
    job_ids = sorted(p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert len(job_ids) == 3 and len({j.split("_")[0] for j in job_ids}) == 1, job_ids
    for (
        job
    ) in job_ids:  # submitit reads a job's result file as soon as it is written: the job may still be ending
        info = cluster.wait(job, timeout=60)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
