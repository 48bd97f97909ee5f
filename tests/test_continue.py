"""A stopped run continues from its own record (distlib/launch/continuation.py): Ctrl-C a run with
settings of its own under `python train.py` and under torchrun, type the line it printed, and the
finished run is bitwise the uninterrupted one; an override at the continuation is recorded beside
the original; a continuation with nothing left to train says so and changes nothing."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e import ROOT, free_port

from distlib.launch import continuation

pytestmark = pytest.mark.slow

# None of these is the default (train.steps=20, lr 1e-3, 4 ranks): a continuation with conf/'s
# defaults instead of the run's own would stop at once or part from the uninterrupted bits.
SETTINGS = [
    "train.steps=80",
    "optimizer.lr=0.002",
    "train.monotone_until_step=0",
    "dist.world_size=2",
    "metrics.progress_every=0",
]
PRINTED = re.compile(r"continue with (checkpoint\.resume=latest hydra\.run\.dir=\S+)")


def _launcher(kind: str) -> list[str]:
    if kind == "python":
        return [sys.executable, "train.py"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "train.py",
    ]


def _run(cmd: list[str], log: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    log.write_text(proc.stdout + proc.stderr)
    return proc


def _losses(run_dir: Path) -> dict[int, str]:
    """Each step's loss as logged last (a continuation logs the steps after its checkpoint)."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss_hex"] for r in records if r["type"] == "step"}


def _interrupt(cmd: list[str], run_dir: Path, at_step: int) -> tuple[int, str]:
    """Run ``cmd`` in its own session, press Ctrl-C (SIGINT to its process group) once
    ``at_step`` is logged; returns its exit status and everything it printed."""
    out = run_dir.with_suffix(".out")
    with out.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while not (run_dir / "metrics.jsonl").exists() or max(_losses(run_dir), default=0) < at_step:
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out.read_text()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, str]:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    proc = _run([*_launcher("python"), f"hydra.run.dir={run_dir}", *SETTINGS], run_dir.with_suffix(".log"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(run_dir)


@pytest.mark.parametrize("kind", ["python", "torchrun"])
def test_the_printed_line_continues_the_run_bitwise(tmp_path, uninterrupted, kind):
    run_dir = tmp_path / "run"
    code, printed = _interrupt([*_launcher(kind), f"hydra.run.dir={run_dir}", *SETTINGS], run_dir, at_step=10)
    # torchrun's agent ends a Ctrl-C with its own traceback and exit 1 (torch's code, not ours)
    assert code == 0 or kind == "torchrun", printed[-3000:]
    stopped_at = max(_losses(run_dir))
    assert stopped_at < 80, "the run ended before Ctrl-C: nothing was tested"
    line = PRINTED.findall(printed)
    assert line and len(set(line)) == 1, printed[-2000:]
    record = (run_dir / ".hydra" / "overrides.yaml").read_bytes()

    proc = _run([*_launcher(kind), *line[0].split()], tmp_path / "continued.log")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints'}" in proc.stdout
    assert _losses(run_dir) == uninterrupted and len(uninterrupted) == 80
    assert (run_dir / ".hydra" / "overrides.yaml").read_bytes() == record  # the run's own settings kept
    assert not list((run_dir / ".hydra").glob("continue-*")), "nothing was overridden, nothing recorded"


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_nothing_left_to_train_changes_nothing_and_an_override_is_recorded_beside(tmp_path):
    run_dir = tmp_path / "run"
    settings = [
        "train.steps=12",
        "train.monotone_until_step=0",
        "dist.world_size=2",
        "checkpoint.every_steps=4",
    ]
    assert (
        _run([*_launcher("python"), f"hydra.run.dir={run_dir}", *settings], tmp_path / "a.log").returncode
        == 0
    )
    before = _snapshot(run_dir)
    again = [*_launcher("python"), "checkpoint.resume=latest", f"hydra.run.dir={run_dir}"]
    proc = _run(again, tmp_path / "b.log")
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"nothing to train: {run_dir / 'checkpoints' / 'step_00000012'} is at step 12 and train.steps=12; "
        "pass train.steps=N with N > 12 to train further (the run is left as it is)"
    ]
    assert _snapshot(run_dir) == before

    proc = _run([*again, "train.steps=16"], tmp_path / "c.log")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(_losses(run_dir)) == list(range(1, 17))
    assert all(_snapshot(run_dir)[name] == before[name] for name in before if name.startswith(".hydra/"))
    record = run_dir / ".hydra" / "continue-1"
    assert (record / "overrides.yaml").read_text().split() == [
        "-",
        "train.monotone_until_step=0",
        "-",
        "dist.world_size=2",
        "-",
        "checkpoint.every_steps=4",
        "-",
        "train.steps=16",
    ]
    assert (
        "steps: 16" in (record / "config.yaml").read_text()
        and "monotone_until_step: 0" in (record / "config.yaml").read_text()
    )


@pytest.mark.parametrize("attempt", [0, 1, 3])
@pytest.mark.parametrize("resume", [None, "", "none", "null", "latest", "/runs/a/checkpoints/step_00000004"])
def test_a_restart_resumes_the_latest_checkpoint_only_where_resume_was_unset(attempt, resume):
    tree = {"checkpoint": {"resume": resume, "every_steps": 4}, "train": {"steps": 8}}
    got, line = continuation.resumed_on_restart(tree, attempt)
    unset = resume in (None, "", "none", "null")
    want = "latest" if attempt and unset else resume
    assert got["checkpoint"] == {"resume": want, "every_steps": 4} and got["train"] == {"steps": 8}
    assert tree["checkpoint"]["resume"] == resume  # the caller's tree is left as it was
    assert (line is not None) == bool(attempt and unset)
    if line:
        assert line.startswith(f"restart {attempt} of the job: checkpoint.resume was not set")
