"""scripts/report.py on real runs: a single run (with a rollback), a sweep directory, bad input.
PNGs need the optional matplotlib; without it the text report says they were skipped."""

import importlib.util
import subprocess
from pathlib import Path

import pytest
from forkrun import run_script
from multiproc import run_ranks

from distlib.app.config.run import RunConfig
from distlib.app.faults import step_hooks
from distlib.app.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _train(comm, tree, run_dir):
    cfg = RunConfig.from_dict(tree)
    Trainer(cfg, comm, Path(run_dir), hooks=step_hooks(cfg.fault, comm.rank)).run()


def make_run(run_dir: Path, world: int, **faults) -> Path:
    tree = {
        "dist": {"world_size": world},
        "train": {"steps": 8},
        "checkpoint": {"every_steps": 4},
        "metrics": {"progress_every": 0},
        "fault": faults,
    }
    run_ranks(_train, world, tree, str(run_dir))
    return run_dir


def report(*args) -> subprocess.CompletedProcess:
    return run_script("scripts/report.py", *map(str, args))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    sweep = tmp_path_factory.mktemp("sweep")
    return (
        sweep,
        make_run(sweep / "0_ws1", 1),
        make_run(sweep / "1_ws2", 2, lr_spike_step=5, lr_spike_factor=100.0),
    )


def test_single_run_summary_names_losses_rollbacks_checkpoints_and_memory(runs, tmp_path):
    _, _, spiked = runs
    proc = report(spiked, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert (tmp_path / "report.txt").read_text() == text
    assert "status: completed" in text and "steps logged: 8 (steps 1..8), world size 2" in text
    assert "rollback at step 6 -> step 4: loss spike" in text
    assert "checkpoints: 2 saved (every_steps), last at step 8" in text  # step 4 was trusted: not re-saved
    assert "reduce_scatter" in text and "memory at the last step (max / mean over ranks)" in text
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "PNGs skipped: matplotlib is not installed" in text
        assert not (tmp_path / "loss.png").exists()


def test_sweep_directory_compares_the_jobs_side_by_side(runs, tmp_path):
    sweep, _, _ = runs
    proc = report(sweep, "--out", tmp_path, "--no-png")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"sweep: {sweep} (2 jobs)"
    table = lines[lines.index(next(line for line in lines if line.startswith("job "))) :][:3]
    assert table[1].split()[:3] == ["0_ws1", "1", "8"] and table[2].split()[:3] == ["1_ws2", "2", "8"]
    assert table[1].split()[-1] == "completed" and table[2].split()[-2:] == ["1", "completed"]  # rollbacks
    # Same global batch at 1 and 2 ranks: the final losses agree to fp32 reduction order.
    final = [float(row.split()[3]) for row in table[1:]]
    assert final[0] == pytest.approx(final[1], rel=1e-5)
    assert "charts: not requested (--no-png)" in proc.stdout


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is an optional extra (pip install matplotlib)")
def test_sweep_loss_chart_is_written_with_matplotlib(runs, tmp_path):
    sweep, _, _ = runs
    proc = report(sweep, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_directory_without_metrics_is_refused_clearly(tmp_path):
    proc = report(tmp_path)
    assert proc.returncode == 2 and "no metrics.jsonl in" in proc.stderr
    proc = report(tmp_path / "missing")
    assert proc.returncode == 2 and "is not a directory" in proc.stderr
