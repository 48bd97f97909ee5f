import gc
import os
import sys
import time
from pathlib import Path

# The package `distlib` shadows PyPI's `distlib`; make sure ours (repo root) wins.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

# Hugging Face tokenizers' rayon pool, once used, leaves threads alive in this process, and the
# suite forks ranks from it (see _no_thread_left_behind below): keep tokenizers single-threaded.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

# torch.utils.checkpoint's recomputation imports torch._dynamo at its first call, 2.1 s a process: the
# ranks forked from this process inherit it, as train.py's workers inherit it from their launcher
# (distlib/app/model/recompute.py). Importing it starts no thread.
import torch._dynamo  # noqa: E402, F401


def _run_once(cmd: list[str], timeout: float, **env: str):
    """``cmd`` from the repository root, output captured, unbuffered, with ``env`` added."""
    import subprocess

    return subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
    )


@pytest.fixture(scope="session")
def pinned_reference(request, tmp_path_factory):
    """A function returning the pinned known-good commit's bits on this machine (golden layouts
    and the old-checkpoint fixture's resume; tests/pinned_reference.py), built at its first call
    only, cached in pytest's cache directory for later sessions; it skips the calling test, saying
    why, where the commit cannot be run here."""
    from pinned_reference import Unavailable, build

    cache = getattr(request.config, "cache", None)
    where = cache.mkdir("pinned-reference") if cache else tmp_path_factory.mktemp("pinned-reference")
    memo = {}

    def get() -> dict:
        if not memo:
            try:
                memo["ref"] = build(Path(where))
            except Unavailable as why:
                memo["ref"] = why
        if isinstance(memo["ref"], Unavailable):
            pytest.skip(f"no bitwise reference for this machine: {memo['ref']}")
        return memo["ref"]

    return get


@pytest.fixture(scope="session")
def capstone_run(tmp_path_factory):
    """The capstone exactly as README.md's first command runs it (`torchrun --nproc_per_node 4
    train.py`, only the run directory given), once per session: tests/test_capstone.py checks its
    output and invariants, tests/test_readme_commands.py that the command runs and that the README
    commands reading outputs/<run> work on it. Returns (the CompletedProcess, the run directory)."""
    from e2e import free_port

    run_dir = tmp_path_factory.mktemp("capstone") / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "4",
        "train.py",
        f"hydra.run.dir={run_dir}",
    ]
    # PET_MASTER_PORT is torchrun's own environment default for --master-port: the command stays
    # README's, the port is a free one (29500 could be taken by another run on the machine).
    # PYTHONPROFILEIMPORTTIME only logs each process's imports to stderr, for
    # tests/test_startup.py's check that no process imports the compiler.
    env = {"PET_MASTER_PORT": str(free_port()), "PYTHONPROFILEIMPORTTIME": "1"}
    return _run_once(cmd, 240, **env), run_dir


@pytest.fixture(scope="session")
def resume_script_run(tmp_path_factory):
    """README.md's `bash scripts/resume.sh`, run as written (RESUME_DIR keeps its two runs), once
    per session: tests/test_resume.py checks what it proves, tests/test_readme_commands.py that the
    README command runs. Returns (the CompletedProcess, RESUME_DIR)."""
    out = tmp_path_factory.mktemp("resume_script")
    return _run_once(["bash", "scripts/resume.sh"], 300, RESUME_DIR=str(out)), out


# README.md's sweep line as tests/test_readme_commands.py runs it (fewer steps, a checkpoint, the
# sweep directory given); {dir} is the sweep directory.
SWEEP_CMD = (
    ".venv/bin/python train.py -m dist.world_size=1,2,4 train.steps=4 checkpoint.every_steps=2 "
    "hydra.sweep.dir={dir}"
)


@pytest.fixture(scope="session")
def world_size_sweep(tmp_path_factory):
    """README.md's `train.py -m dist.world_size=1,2,4` (as SWEEP_CMD), once per session:
    tests/test_cli.py checks its jobs, tests/test_readme_commands.py that the README line runs.
    Returns (the CompletedProcess, the sweep directory)."""
    sweep = tmp_path_factory.mktemp("sweep")
    cmd = SWEEP_CMD.format(dir=sweep).replace(".venv/bin/python", sys.executable, 1).split()
    return _run_once(cmd, 300), sweep


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture(autouse=True)
def _no_thread_left_behind():
    """Tests fork ranks from this process (tests/multiproc.py, tests/forkrun.py), and a thread
    alive at a fork can leave a lock held forever in the child: a test that leaves one behind
    (a store server, a progress thread) makes a later test hang for its whole timeout. So each
    test must end with as many threads as it began with; the one that does not is named here."""
    before = _threads()
    yield
    if _threads() > before:
        gc.collect()  # a cycle may still hold a store or a thread's owner
        for _ in range(50):
            if _threads() <= before:
                return
            time.sleep(0.02)
        pytest.fail(
            f"this test left {_threads() - before} thread(s) running in the test process "
            f"({before} before, {_threads()} after); later forks could hang",
            pytrace=False,
        )


# `make test` runs the suite on two pytest-xdist workers (Makefile), then the few tests marked
# serial alone: their wall-clock bound has little slack (a rank must arrive within the 1 s given
# to an absent one; the roll call ends within ~2 s of a death) and another worker's 4-rank job on
# the same 2 cores could stretch it. The other bounds in the suite leave 5-15x what they measure
# (survivors gone in 0.1 s of 1.5 s allowed). An xdist worker process has one thread besides the
# main one (execnet's reader, blocked on its pipe between messages); the ranks and scripts forked
# from it touch nothing of it and leave with os._exit, so the fork hazard above does not apply.
SESSION_RUNS = {"capstone_run", "resume_script_run", "world_size_sweep"}
# The files with a test that uses one of them: one worker takes them all, so each run happens once.
SESSION_FILES = {
    f"tests/{name}.py"
    for name in (
        "test_capstone",
        "test_cli",
        "test_readme_commands",
        "test_resume",
        "test_startup",
        "test_unattended_e2e",
    )
}


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, called only when it runs
def pytest_xdist_make_scheduler(config, log):
    """A file at a time to a worker (its module fixtures run once), SESSION_FILES as one unit, in
    the order the workers collected them (Makefile: --no-loadscope-reorder). pytest 9.2 ignores
    the node ids xdist's own `loadgroup` rewrites, so the grouping is done here."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "session_runs" if _file(nodeid) in SESSION_FILES else _file(nodeid)

    return ByFile(config, log)


def pytest_collection_modifyitems(config, items):
    """Every user of a session run is in SESSION_FILES (else a second worker would repeat the run).
    Under xdist the units go out longest first: the session files, then the files with end-to-end
    tests, then the rest, whose many short tests fill the gaps at the end instead of one long run
    started last keeping one worker busy while the other idles."""
    strays = [
        i.nodeid for i in items if SESSION_RUNS & set(i.fixturenames) and _file(i.nodeid) not in SESSION_FILES
    ]
    if strays:
        raise pytest.UsageError(f"tests/conftest.py: add the files of {strays} to SESSION_FILES")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a plain `pytest` keeps the files' order
        slow_files = {item.path for item in items if item.get_closest_marker("slow")}
        # a stable sort: each file's tests stay together and in order
        items.sort(key=lambda i: 0 if _file(i.nodeid) in SESSION_FILES else 1 if i.path in slow_files else 2)
