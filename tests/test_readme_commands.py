"""Every command of README.md's quick start and entry-point list still runs.

The commands are read from README.md itself, so a command added there without a way to run it
here fails ``test_every_readme_command_is_covered``. Each runs as written, except: long runs get
fewer steps (``train.steps=...`` overrides appended or replaced), output goes to a temporary
directory (``hydra.run.dir`` / ``hydra.sweep.dir``), ``outputs/<run>`` stands for the run the
capstone command made and ``outputs/<text run>`` for a 20-step ``data=text`` run, and the ``make``
targets are checked with ``make -n`` (``make test`` would run this suite inside itself; ``make
bench`` takes minutes; ``make demo`` is the torchrun command below, run for real, and
``tests/test_capstone.py`` checks its output).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SWEEP_CMD
from e2e import ROOT

pytestmark = pytest.mark.slow

README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    """The bash lines of the quick start (the first two code blocks), comments stripped."""
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", quick, re.S)
    lines = [line.split("  #")[0].split(" # ")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _with_overrides(cmd: str, run_dir: Path, steps: int = 4) -> str:
    cmd = re.sub(r"train\.steps=\d+", f"train.steps={steps}", cmd)
    extra = [] if "train.steps=" in cmd else [f"train.steps={steps}"]
    extra.append("checkpoint.every_steps=2")
    key = "hydra.sweep.dir" if " -m " in cmd else "hydra.run.dir"
    return " ".join([cmd, *extra, f"{key}={run_dir}"])


def _run(cmd: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env_py = Path(sys.executable)
    # README says .venv/bin/...; the suite may run from another interpreter with the same packages
    cmd = cmd.replace(".venv/bin/python", str(env_py)).replace(
        ".venv/bin/torchrun", f"{env_py} -m torch.distributed.run"
    )
    return subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def capstone(capstone_run) -> Path:
    """outputs/<run> of the README: the capstone, run exactly as the README's first line says
    (conftest.py's capstone_run, shared with tests/test_capstone.py)."""
    proc, run_dir = capstone_run
    assert proc.returncode == 0 and "RESUME VERIFIED" in proc.stdout, proc.stderr[-2000:]
    return run_dir


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> Path:
    """outputs/<text run>: the README's data=text command, 20 steps (so step 20 exists)."""
    run_dir = tmp_path_factory.mktemp("readme") / "text"
    proc = _run(f".venv/bin/python train.py data=text train.steps=20 hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


def runnable(cmd: str, capstone: Path, text: Path, tmp: Path) -> str | None:
    """The command as this test runs it, or None for the make targets (checked by make -n)."""
    if cmd.startswith("make "):
        return None
    if (
        cmd.startswith(".venv/bin/torchrun --nproc_per_node 4 train.py")
        and cmd.split("train.py")[1].strip() == ""
    ):
        return None  # the capstone itself: the fixture ran it
    if "outputs/<text run>" in cmd:
        return cmd.replace("outputs/<text run>", str(text))
    if "outputs/<run>" in cmd:
        return cmd.replace("outputs/<run>", str(capstone))
    return _with_overrides(cmd, tmp / "run")


def test_every_readme_command_is_covered():
    cmds = readme_commands()
    assert len(cmds) >= 10, cmds
    for cmd in cmds:
        assert cmd.startswith((".venv/bin/", "make ", "bash scripts/")), (
            f"README command this test cannot run: {cmd}"
        )


@pytest.mark.parametrize("cmd", readme_commands())
def test_readme_command_runs(cmd, capstone, request, tmp_path):
    if cmd.startswith("make "):
        target = cmd.split()[1]
        proc = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
        return
    if cmd.startswith("bash scripts/resume.sh"):  # run as written, once, for this test and test_resume.py
        assert cmd == "bash scripts/resume.sh", f"conftest.py's resume_script_run runs no other form: {cmd}"
        proc, _ = request.getfixturevalue("resume_script_run")
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}"
        return
    text = request.getfixturevalue("text_run") if "<text run>" in cmd else None
    real = runnable(cmd, capstone, text, tmp_path)
    if real is None:
        return
    if real == SWEEP_CMD.format(dir=tmp_path / "run"):  # run once, for this test and test_cli.py
        proc, _ = request.getfixturevalue("world_size_sweep")
        assert proc.returncode == 0, f"{real}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}"
        return
    proc = _run(real)
    assert proc.returncode == 0, f"{real}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}"
