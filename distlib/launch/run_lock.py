"""One job per run directory: an exclusive lock, held while the job runs.

A job takes ``<run dir>/.distlib.lock`` (and the same file in ``checkpoint.dir`` when that lies
outside the run directory) with ``flock`` before it writes anything there, and holds it until its
process exits. The kernel drops an flock when its holder exits however it exits, SIGKILL
included, so a crashed or killed job never leaves a stale lock behind: the next job, a torchrun
restart (whose new rank 0 starts after the old workers are gone) or a SLURM requeue takes it at
once. The file's content names the holder (host, pid, start time, job), which a second job that
finds the lock taken prints in its one-line refusal; nothing of the first job's is touched.

Who holds it: the first process of the job that composes its config -- ``python train.py``'s
launcher (its workers inherit the right: ``DISTLIB_RUN_LOCK`` names the directories and the holder,
their parent), or, under torchrun or srun, rank 0.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_NAME = ".distlib.lock"
ENV = "DISTLIB_RUN_LOCK"
_held: list = []  # the open lock files of this process (closing one would release it)


class BusyError(RuntimeError):
    """The run directory is in use by another job."""


def _holder() -> dict:
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "job": job,
    }


def _describe(raw: str) -> str:
    try:
        h = json.loads(raw)
        return f"host {h['host']}, pid {h['pid']}, started {h['started']}" + (
            f", job {h['job']}" if h["job"] else ""
        )
    except (ValueError, KeyError, TypeError):
        return "a job whose details are not written yet"


def _try_lock(f, directory: Path, key: str) -> None:
    """flock ``f`` (the lock file of ``directory``), or close it and raise BusyError naming the holder."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raw = f.read()
        f.close()
        raise BusyError(
            f"{directory} is in use by another job ({_describe(raw)}); wait for it to end, or "
            f"choose another {key}"
        ) from None


def _take(directory: Path, key: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    f = open(directory / LOCK_NAME, "a+")  # never truncated before the lock is ours
    _try_lock(f, directory, key)
    f.seek(0)
    f.truncate()
    f.write(json.dumps(_holder()))
    f.flush()
    _held.append(f)


def _dirs(run_dir: Path, checkpoint_root: Path) -> list[Path]:
    run_dir, checkpoint_root = Path(run_dir).resolve(), Path(checkpoint_root).resolve()
    return [run_dir] if checkpoint_root.is_relative_to(run_dir) else [run_dir, checkpoint_root]


def refuse_if_held(run_dir: Path, checkpoint_root: Path) -> None:
    """BusyError naming the holder if another job holds a lock of these directories; writes and
    creates nothing (for a job that is refused anyway: the reason it gives is the other job)."""
    for d, key in zip(_dirs(run_dir, checkpoint_root), ("hydra.run.dir", "checkpoint.dir")):
        try:
            f = open(d / LOCK_NAME)
        except FileNotFoundError:
            continue
        _try_lock(f, d, key)
        f.close()  # the lock was free: released with the file


def hold(run_dir: Path, checkpoint_root: Path) -> None:
    """Take the job's locks, or raise BusyError naming the holder. Inherited (ENV) when this
    process's parent holds them for the same directories."""
    dirs = _dirs(run_dir, checkpoint_root)
    inherited = json.loads(os.environ.get(ENV, "null"))
    if inherited and inherited["pid"] == os.getppid() and inherited["dirs"] == [str(d) for d in dirs]:
        return
    for d, key in zip(dirs, ("hydra.run.dir", "checkpoint.dir")):
        _take(d, key)
    os.environ[ENV] = json.dumps({"pid": os.getpid(), "dirs": [str(d) for d in dirs]})
