"""Every command of README.md runs, and prints what the README shows it printing.

The commands are read from README.md itself (tests/doc_commands.py: its code blocks and markers),
so a command added there that fails, or that nothing here knows how to run, fails a test. Each
runs as written from the repository root, except that what it writes goes to a temporary
directory (``hydra.run.dir`` appended, ``hydra.sweep.dir`` for the sweep, ``data.cache_dir`` for
the text's token cache), ``outputs/<run>`` stands for the run the capstone command made and
``outputs/<text run>`` for the run of the ``data=text`` command. Runs other tests need too are the
session's (tests/conftest.py): the capstone (``make demo``'s recipe is that command: checked with
``make -n``), ``bash scripts/resume.sh`` and the sweep (as conftest's SWEEP_CMD: 4 steps, a
checkpoint at step 2). A ``make`` target the README shares with docs/ runs in
tests/test_doc_commands.py; the README marks the rest (``make test`` would run this suite inside
itself; ``make bench`` takes minutes).
"""

import subprocess
import sys
from pathlib import Path

import doc_commands
import pytest
from conftest import SWEEP_CMD
from e2e import ROOT

README = doc_commands.parse("README.md")
RUNNABLE = [c for c in README.commands if c.skip is None]
CAPSTONE = ".venv/bin/torchrun --nproc_per_node 4 train.py"
SWEEP = ".venv/bin/python train.py -m dist.world_size=1,2,4"
TEXT = ".venv/bin/python train.py data=text"


def _docs_run(cmd: str) -> bool:
    """Whether docs/ has the same command unmarked, so tests/test_doc_commands.py runs it."""
    return any(
        c.key == cmd and c.skip is None
        for path in doc_commands.documents()
        for c in doc_commands.parse(path).commands
    )


def _run(cmd: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env_py = Path(sys.executable)
    # README says .venv/bin/...; the suite may run from another interpreter with the same packages
    cmd = cmd.replace(".venv/bin/python", str(env_py)).replace(
        ".venv/bin/torchrun", f"{env_py} -m torch.distributed.run"
    )
    return subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _shows(cmd: doc_commands.Command, printed: str) -> None:
    """Every output the README shows for ``cmd`` is in what it printed."""
    for shown in cmd.outputs:
        assert shown.recorded_on is None, f"{cmd.id}: the README shows one machine kind's output"
        missing = doc_commands.output_mismatches(shown.lines, printed)
        assert not missing, f"{cmd.id}: README shows lines the run did not print:\n" + "\n".join(missing)


@pytest.fixture(scope="module")
def capstone(capstone_run) -> Path:
    """outputs/<run> of the README: the capstone, run exactly as the README's first line says
    (conftest.py's capstone_run, shared with tests/test_capstone.py)."""
    proc, run_dir = capstone_run
    assert proc.returncode == 0 and "RESUME VERIFIED" in proc.stdout, proc.stderr[-2000:]
    return run_dir


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """outputs/<text run>: the README's data=text command, as written."""
    tmp = tmp_path_factory.mktemp("readme")
    # the token cache goes to tmp too: nothing is written beside data/sample.txt
    return _run(f"{TEXT} hydra.run.dir={tmp / 'text'} data.cache_dir={tmp / 'cache'}"), tmp / "text"


def test_readme_follows_the_rules():
    assert not README.problems, "\n".join(README.problems)
    keys = [c.key for c in README.commands]
    assert {CAPSTONE, SWEEP, TEXT} <= set(keys), keys
    for cmd in RUNNABLE:
        assert cmd.key.startswith((".venv/bin/", "make ", "bash scripts/")), (
            f"{cmd.id}: cannot run: {cmd.key}"
        )
        if cmd.key.startswith("make ") and cmd.key != "make demo":
            assert _docs_run(cmd.key), f"{cmd.id}: `{cmd.key}` runs nowhere: run it in docs/ too, or mark it"


@pytest.mark.slow
@pytest.mark.parametrize("cmd", RUNNABLE, ids=[c.id for c in RUNNABLE])
def test_readme_command_runs(cmd, capstone, capstone_run, request, tmp_path):
    key = cmd.key
    if key == "make demo":  # its recipe is the capstone's command, which capstone_run ran
        # --no-print-directory: under `make test` (MAKELEVEL 1) make -n adds "Entering directory" lines
        proc = subprocess.run(
            ["make", "--no-print-directory", "-n", "demo"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        recipe = proc.stdout.strip().splitlines()[-1]
        assert recipe == CAPSTONE.replace(
            ".venv/bin/torchrun", ".venv/bin/python -m torch.distributed.run"
        ), recipe
        return
    if key.startswith("make "):  # tests/test_doc_commands.py runs it (test_readme_follows_the_rules)
        return
    if key == CAPSTONE:
        _shows(cmd, capstone_run[0].stdout)
        return
    if key == "bash scripts/resume.sh":  # run as written, once, for this test and test_resume.py
        proc, _ = request.getfixturevalue("resume_script_run")
        assert proc.returncode == 0, f"{key}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}"
        _shows(cmd, proc.stdout + proc.stderr)
        return
    if key == SWEEP:  # as conftest's SWEEP_CMD, run once, for this test and test_cli.py
        assert SWEEP_CMD.startswith(key + " "), SWEEP_CMD
        proc, _ = request.getfixturevalue("world_size_sweep")
        assert proc.returncode == 0, f"{SWEEP_CMD}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}"
        return
    if key == TEXT:
        proc, _ = request.getfixturevalue("text_run")
    else:
        real = key  # the README's commands are one line each: this is cmd.text without its comment
        if "outputs/<text run>" in real:
            real = real.replace("outputs/<text run>", str(request.getfixturevalue("text_run")[1]))
        real = real.replace("outputs/<run>", str(capstone))
        if " train.py" in real:
            real += f" {'hydra.sweep.dir' if ' -m ' in real else 'hydra.run.dir'}={tmp_path / 'run'}"
        proc = _run(real)
    assert proc.returncode == 0, f"{cmd.text}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}"
    _shows(cmd, proc.stdout + proc.stderr)
