"""How a job's processes end and begin: survivors of a dead worker leave at once naming it, a
killed launcher leaves no orphans, no /dev/shm and no stale lock, and one job holds a run
directory at a time (a second is refused naming the holder). A torchrun restart whose rank 0 was
killed taking the lock again is tests/test_chaos.py's (rank 0 is among its victims)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _torchrun_job import Job, _alive  # noqa: E402

from distlib.checkpoint import memory_snapshot as shm  # noqa: E402
from distlib.launch import run_lock  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

LONG = [
    "train.steps=100000",
    "checkpoint.every_steps=0",
    "checkpoint.verify_resume=false",
    "metrics.progress_every=0",
]


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not any(_alive(p) for p in pids)


def test_the_survivors_of_a_killed_worker_leave_at_once_each_naming_it(tmp_path):
    job = Job(tmp_path / "run", ["dist.world_size=4", *LONG], nproc=4).start()
    job.wait_for(lambda: job.last_step() >= 3, what="3 steps")
    workers = job.workers()
    victim = next(p for p in workers if b"RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes())
    t_kill = job.kill(victim)
    survivors = [p for p in workers if p != victim]
    assert _gone_within(survivors, 10)
    gone = max(job.seen[p][1] for p in survivors) - t_kill
    job.finish()
    err = job.output()[1]
    lines = [line for line in err.splitlines() if line.startswith("error [rank")]
    said = sorted(line[: len("error [rank 0]")] for line in lines)
    assert said == [f"error [rank {r}]" for r in (0, 2, 3)], err
    exited = "rank(s) [1] did not arrive: their process(es) on this host exited"
    assert all(exited in line for line in lines), err
    assert gone < 1.5, f"the survivors took {gone:.2f} s to leave"  # 0.1 s here; they used to take ~7 s


@pytest.mark.parametrize("launcher", ["torchrun", "python train.py", "python train.py dist.max_restarts=1"])
def test_a_launcher_killed_by_sigkill_leaves_no_worker_and_no_snapshot(tmp_path, launcher):
    run = tmp_path / "run"
    args = [f"hydra.run.dir={run}", "dist.world_size=2", "checkpoint.memory_every_steps=1", *LONG]
    args += launcher.split()[2:]  # the own agent's key
    if launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0",
            "train.py",
            *args,
        ]
    else:
        cmd = [sys.executable, "train.py", *args]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    snapshots = shm.job_dir(run)
    deadline = time.monotonic() + 120
    while not list(snapshots.glob("step*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    workers, server = _workers(proc.pid)
    assert len(workers) == 2 and list(snapshots.glob("step*")), "the run did not get going"
    assert bool(server) == launcher.startswith("python train.py"), "python train.py's server is no fork of it"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _gone_within(workers + server, 2), "workers (or the fork server) outlived their launcher"
    deadline = time.monotonic() + 2
    while snapshots.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not snapshots.exists(), "the job's /dev/shm directory outlived its launcher"
    # nor its lock: the next job in the directory runs (the kernel dropped the killed job's flock)
    out, err, code = _train(run, "train.steps=2", "checkpoint.every_steps=0", "checkpoint.resume=latest")
    assert code == 0, err[-2000:]


def _children(pid: int) -> list[int]:
    return [
        int(p)
        for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    ]


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _workers(launcher: int) -> tuple[list[int], list[int]]:
    """A launcher's workers, and the fork server that started them if any. torchrun's are its
    children with torch's environment; python train.py's are forks of its fork server, itself a
    fork of the launcher (distlib/launch/prefork.py), whose command line they all keep."""
    servers = [c for c in _children(launcher) if _cmdline(c) == _cmdline(launcher)]
    if servers:
        return [w for w in _children(servers[0]) if _cmdline(w) == _cmdline(servers[0])], servers
    children = _children(launcher)
    return [c for c in children if b"TORCHELASTIC_RUN_ID" in Path(f"/proc/{c}/environ").read_bytes()], []


def _train(run: Path, *args: str, wait: bool = True):
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run}", "dist.world_size=2", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc.communicate(timeout=240) + (proc.returncode,) if wait else proc


def test_a_second_job_in_a_busy_run_directory_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    # ~12 s of steps, ~11 of them after the first commit: the two refused jobs must get to their
    # lock while the first still holds it (each needs a start-up, ~3-6 s with the suite around it)
    slow = ["fault.slow_rank=0", "fault.slow_seconds=0.3", "metrics.progress_every=0"]
    first = _train(run, "train.steps=40", "checkpoint.every_steps=2", *slow, wait=False)
    deadline = time.monotonic() + 120
    committed = run / "checkpoints" / "step_00000002" / "manifest.json"
    while not committed.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    # a resume, and a fresh run over the first job's committed checkpoint: both name the holder
    # (the lock is taken before the checkpoints are looked at)
    fresh = _train(run, "train.steps=30", wait=False)
    out, err, code = _train(run, "train.steps=30", "checkpoint.resume=latest")
    fresh_err = fresh.communicate(timeout=240)[1]
    holder = json.loads((run / run_lock.LOCK_NAME).read_text())
    assert fresh.returncode == 1 and fresh_err.startswith(f"error: {run} is in use by another job"), fresh_err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(
        f"error: {run} is in use by another job (host {holder['host']}, pid {holder['pid']}, "
        f"started {holder['started']}"
    ), err
    assert holder["pid"] == first.pid
    first_out, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in records if r.get("event") in ("run_start", "restart")]
    steps = [r["step"] for r in records if r["type"] == "step"]
    assert len(starts) == 1 and steps == list(range(1, 41)), "the refused job wrote into the first job's run"


_HOLD = (
    "import sys; from distlib.launch import run_lock; run_lock.hold(sys.argv[1], sys.argv[2]); "
    "print('held', flush=True); sys.stdin.read()"
)


def test_a_checkpoint_directory_outside_the_run_is_locked_too(tmp_path):
    """Two jobs in different run directories sharing one checkpoint.dir: the second is refused,
    naming the checkpoint directory, its key and the holder; the first job's lock file is intact."""
    shared = tmp_path / "checkpoints"
    first = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path / "a"), str(shared)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout.readline() == "held\n"
        held = (shared / run_lock.LOCK_NAME).read_text()
        second = subprocess.run(
            [sys.executable, "-c", _HOLD, str(tmp_path / "b"), str(shared)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode != 0
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(f"distlib.launch.run_lock.BusyError: {shared} is in use by another job "), last
        assert f"pid {first.pid}," in last and last.endswith("choose another checkpoint.dir"), last
        assert (shared / run_lock.LOCK_NAME).read_text() == held
    finally:
        first.communicate(input="", timeout=60)
