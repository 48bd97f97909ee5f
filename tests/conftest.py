import os
import sys

# The package `distlib` shadows PyPI's `distlib`; make sure ours (repo root) wins.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def capstone_run(tmp_path_factory):
    """The capstone exactly as README.md's first command runs it (`torchrun --nproc_per_node 4
    train.py`, only the run directory given), once per session: tests/test_capstone.py checks its
    output and invariants, tests/test_readme_commands.py that the command runs and that the README
    commands reading outputs/<run> work on it. Returns (the CompletedProcess, the run directory)."""
    import subprocess
    run_dir = tmp_path_factory.mktemp("capstone") / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "train.py", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, run_dir


@pytest.fixture(scope="session")
def resume_script_run(tmp_path_factory):
    """README.md's `bash scripts/resume.sh`, run as written (RESUME_DIR keeps its two runs), once
    per session: tests/test_resume.py checks what it proves, tests/test_readme_commands.py that the
    README command runs. Returns (the CompletedProcess, RESUME_DIR)."""
    import subprocess
    out = tmp_path_factory.mktemp("resume_script")
    proc = subprocess.run(["bash", "scripts/resume.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "RESUME_DIR": str(out)})
    return proc, out
