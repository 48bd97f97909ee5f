"""dist.layout=auto (distlib/launch/auto_layout.py): python train.py runs the layout the planner
predicts fastest among those whose step peak fits dist.budget_gb, says it as overrides, records it,
and stays within the budget (every tensor alive at once, measured); a budget nothing fits, or
another launcher, is one line."""

from __future__ import annotations

import json

import pytest
import yaml
from forkrun import run_script

from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.plan import candidates, report
from distlib.app.plan.report import GB, plan
from distlib.app.plan.step_peak import rank_step_peaks, stage_step_peak
from distlib.app.plan.timing import Machine
from distlib.launch import auto_layout
from distlib.launch.hydra_config import compose_tree

FIXED = Machine(flops=1e10, op_s=2e-6, byte_s=1e-10, update_s=1e-9, cores=2)
CATEGORIES = ("params", "grads", "optimizer", "activations")


@pytest.fixture
def fixed_machine(monkeypatch):
    """The same machine figures every time, so the test can recompute the planner's choice."""
    monkeypatch.setattr(Machine, "probe", staticmethod(lambda: FIXED))


def chosen(words: list[str]) -> tuple[dict, str]:
    return auto_layout.choose(compose_tree(words), words)


def _step_peak(layout) -> int:
    """The fullest rank's step peak, every stage's dry step run here (not the planner's cache)."""
    stage_step_peak.cache_clear()
    return max(rank_step_peaks(layout.cfg))


def test_the_fastest_layout_whose_step_fits_is_chosen_and_written_as_given(fixed_machine):
    words = ["model=llama", "dist.world_size=4", "dist.layout=auto", "dist.budget_gb=0.0009"]
    tree, line = chosen(words)
    layouts, _ = plan(compose_tree(words), set(), FIXED)
    fitting = sorted((p for p in layouts if p.peak <= 0.0009 * GB), key=lambda p: p.time.total_s)
    assert 0 < len(fitting) < len(layouts)  # the budget rules some out
    # the fastest whose states and activations fit peaks above the budget in its step: passed over
    assert _step_peak(fitting[0]) > 0.0009 * GB
    best = next(p for p in fitting if _step_peak(p) <= 0.0009 * GB)
    assert line == (
        f"dist.layout=auto: {' '.join(best.overrides)}, predicted fastest on this machine "
        f"({1e3 * best.time.total_s:.1f} ms a step) of {len(fitting)} layouts within dist.budget_gb=0.0009, "
        f"its step peaking at {_step_peak(best) / GB:.6g} GB; add these overrides to pin it"
    )
    assert tree["dist"]["layout"] == "given"
    pinned = RunConfig.from_dict(compose_tree([*words[:2], *best.overrides]))
    assert (
        RunConfig.from_dict(tree).layout == pinned.layout
        and tree["zero"] == compose_tree(best.overrides)["zero"]
    )


def test_keys_the_command_line_sets_stay_as_set(fixed_machine):
    words = ["model=llama", "dist.world_size=4", "dist.layout=auto", "dist.tp=2", "zero=stage3"]
    tree, line = chosen(words)
    assert tree["dist"]["tp"] == 2 and tree["zero"]["stage"] == 3 and tree["zero"]["overlap"] is False
    assert "dist.tp" not in line and "zero." not in line


def test_layouts_whose_step_is_not_predicted_get_the_smallest_that_fits(fixed_machine, monkeypatch):
    # as document masks over context-parallel ranks leave a layout (whose data needs a tokenizer
    # here), every layout; tp and cp pinned: the search over the rest is enough here
    monkeypatch.setattr(report, "predicted_time", lambda cfg, machine: None)
    words = ["model=llama", "dist.world_size=4", "dist.layout=auto", "dist.tp=1", "dist.cp=1"]
    tree, line = chosen(words)
    layouts, _ = plan(compose_tree(words), candidates.pinned(words), FIXED)
    assert line == (
        f"dist.layout=auto: {' '.join(layouts[0].overrides)}, the smallest of {len(layouts)} layouts "
        f"(step time not predicted for these layouts), its step peaking at {_step_peak(layouts[0]) / GB:.6g} "
        "GB; add these overrides to pin it"
    )


def test_a_budget_the_states_fit_but_no_step_names_the_smallest_step(fixed_machine):
    words = ["model=llama", "dist.world_size=4", "dist.layout=auto"]
    layouts, _ = plan(compose_tree(words), set(), FIXED)
    budget = f"{layouts[0].peak / GB:.9g}"  # the smallest's states and activations fit exactly
    with pytest.raises(ConfigError) as caught:
        chosen([*words, f"dist.budget_gb={budget}"])
    fitting = [p for p in layouts if p.peak <= float(budget) * GB]
    tried = min(len(fitting), 20)  # (each of those whose states and activations fit, at most 20)
    assert str(caught.value) == (
        f"dist.layout=auto: no layout fits dist.budget_gb={budget} in its step: the {tried} smallest by "
        f"model states and activations peak above it (the first at {_step_peak(fitting[0]) / GB:.6g} GB "
        "on its fullest rank); raise dist.budget_gb or dist.world_size"
    )


def test_a_budget_nothing_fits_names_the_smallest_need(fixed_machine):
    with pytest.raises(ConfigError) as caught:
        chosen(["model=llama", "dist.world_size=4", "dist.layout=auto", "dist.budget_gb=0.0001"])
    said = str(caught.value)
    assert said.startswith("dist.layout=auto: no layout fits dist.budget_gb=0.0001: the smallest holds ")
    assert said.endswith("; raise dist.budget_gb or dist.world_size") and "\n" not in said


def test_train_py_runs_the_chosen_layout_within_the_budget_and_records_it(tmp_path):
    run = tmp_path / "run"
    budget = 0.0009
    proc = run_script(
        "train.py",
        "model=llama",
        "dist.layout=auto",
        f"dist.budget_gb={budget}",
        "train.steps=2",
        "metrics.step_peak=true",
        f"hydra.run.dir={run}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.splitlines()[0]
    assert line.startswith("dist.layout=auto: ") and line.endswith("; add these overrides to pin it")
    overrides = line.removeprefix("dist.layout=auto: ").split(",")[0].split()
    recorded = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    assert recorded["dist"]["layout"] == "given" and recorded["dist"]["budget_gb"] is None
    for override in overrides:  # the recorded configuration is the layout said
        dotted, value = override.split("=")
        group, key = dotted.split(".")
        assert str(recorded[group][key]).lower() == value
    memory = json.loads((run / "report.json").read_text())["memory"]
    assert len(memory) == 4
    for row in memory:  # every rank measured within the budget: every tensor alive at once
        assert sum(row["measured"][c] for c in CATEGORIES) <= budget * GB
        assert 0 < row["measured"]["step_peak"] <= budget * GB


def test_train_py_refuses_a_budget_nothing_fits_and_another_launcher_in_one_line(tmp_path):
    tight = run_script(
        "train.py", "dist.layout=auto", "dist.budget_gb=1e-6", f"hydra.run.dir={tmp_path / 'a'}"
    )
    assert tight.returncode == 2 and len(tight.stderr.splitlines()) == 1
    assert tight.stderr.startswith("config error: dist.layout=auto: no layout fits dist.budget_gb=1e-06")
    task = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0"}
    task |= {"SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_ID": "0"}
    srun = run_script("train.py", "dist.layout=auto", f"hydra.run.dir={tmp_path / 'b'}", env=task)
    assert srun.returncode == 2 and srun.stderr.splitlines() == [
        "config error: dist.layout=auto is chosen by python train.py's launcher before it starts the "
        "workers; here every rank starts as given: run scripts/plan.py and pass its overrides"
    ]


def test_a_budget_without_auto_is_refused_as_one_line(tmp_path):
    """A budget nothing reads would be a promise not kept: dist.budget_gb bounds dist.layout=auto."""
    proc = run_script("train.py", "dist.budget_gb=1", f"hydra.run.dir={tmp_path / 'a'}")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "config error: dist.budget_gb=1 bounds the layout dist.layout=auto picks, and dist.layout is "
        "given: add dist.layout=auto, or drop dist.budget_gb"
    ]
