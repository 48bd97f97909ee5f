"""scripts/report.py on real runs: a single run (with a rollback), a sweep directory, bad input.
PNGs need the optional matplotlib; without it the text report says they were skipped."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from forkrun import run_script
from multiproc import run_ranks

from distlib.app.config.run import RunConfig
from distlib.app.runtime.faults import step_hooks
from distlib.app.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _train(comm, tree, run_dir):
    cfg = RunConfig.from_dict(tree)
    Trainer(cfg, comm, Path(run_dir), hooks=step_hooks(cfg.fault, comm.rank)).run()


def make_run(
    run_dir: Path, world: int, train: dict | None = None, data: dict | None = None, **faults
) -> Path:
    tree = {
        "dist": {"world_size": world},
        "train": {"steps": 8, **(train or {})},
        "checkpoint": {"every_steps": 4},
        "metrics": {"progress_every": 0},
        "fault": faults,
        "data": data or {},
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
    assert "experts:" not in text and not (tmp_path / "experts.png").exists()  # no experts in this model
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


def _report_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("report_script", ROOT / "scripts" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    run = tmp_path_factory.mktemp("evaluated") / "run"
    return make_run(run, 1, train={"eval_every": 2, "eval_windows": 8}, data={"val_fraction": 0.1})


def _val_losses(run_dir: Path) -> dict[int, float]:
    import json

    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["val_loss"] for r in records if r.get("type") == "step" and "val_loss" in r}


def test_the_validation_loss_is_reported_and_plotted(evaluated, tmp_path):
    val = _val_losses(evaluated)
    assert sorted(val) == [2, 4, 6, 8]
    text = report(evaluated, "--out", tmp_path, "--no-png").stdout
    best = min(val, key=val.get)
    assert (
        f"validation loss: first {val[2]:.6f} (step 2), last {val[8]:.6f} (step 8), "
        f"min {val[best]:.6f} (step {best}); 4 evaluations"
    ) in text
    if HAVE_MATPLOTLIB:
        report_py = _report_module()
        plt = report_py._pyplot()
        fig = report_py.loss_figure([report_py.Run.read(evaluated)], plt)
        lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
        assert list(lines["validation loss"].get_xdata()) == [2, 4, 6, 8]
        assert list(lines["validation loss"].get_ydata()) == [val[s] for s in (2, 4, 6, 8)]
        plt.close(fig)


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is an optional extra (pip install matplotlib)")
def test_a_log_axis_says_so_and_curves_on_top_of_each_other_stay_distinguishable(runs, tmp_path):
    sweep, ws1, spiked = runs
    twin = make_run(tmp_path / "2_ws2", 2)  # the same global batch as ws1: the same curve
    report_py = _report_module()
    plt = report_py._pyplot()
    fig = report_py.loss_figure([report_py.Run.read(spiked)], plt)
    assert fig.axes[0].get_yscale() == "log" and "log" in fig.axes[0].get_ylabel()
    plt.close(fig)
    fig = report_py.loss_figure([report_py.Run.read(ws1), report_py.Run.read(twin)], plt)
    first, second = fig.axes[0].get_lines()[:2]
    assert list(first.get_ydata()) == pytest.approx(list(second.get_ydata()), rel=1e-6)
    assert (first.get_linestyle(), first.get_marker()) != (second.get_linestyle(), second.get_marker())
    assert fig.axes[0].get_yscale() == "linear" and fig.axes[0].get_ylabel() == "loss"
    assert second.get_label() == "2_ws2 (on 0_ws1's curve)" and first.get_label() == "0_ws1"
    plt.close(fig)


def test_a_mixture_of_experts_run_reports_its_tokens_per_expert(tmp_path):
    run = tmp_path / "moe"
    tree = {
        "model": {"family": "mixtral", "n_experts": 4, "capacity_factor": 1.0},
        "train": {"steps": 6},
        "checkpoint": {"every_steps": 0},
        "metrics": {"progress_every": 0},
    }
    run_ranks(_train, 1, tree, str(run))
    import json

    records = [
        r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "step"
    ]
    tokens = [r["expert_tokens"] for r in records]
    proc = report(run, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    at = lines.index("experts: 2 blocks x 4 experts; tokens per expert at step 6:")
    for b in range(2):
        load = [max(t[b]) / (sum(t[b]) / 4) for t in tokens]
        assert lines[at + 1 + b] == (
            f"  block {b}: {tokens[-1][b]}  imbalance (max/mean) first {load[0]:.2f}, "
            f"last {load[-1]:.2f}, max {max(load):.2f}"
        )
    dropped = [sum(r["dropped_tokens"][b] for r in records) for b in range(2)]
    assert lines[at + 3] == f"  dropped over capacity in 6 steps, per block: {dropped}" and sum(dropped) > 0
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "experts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
