"""scripts/preset_sweep.py (docs/models.md, Presets): each preset trained as a user starts it, the
guard's trips counted from the run's own metrics, the exit status 1 when one tripped; what it
writes is outside the repository. A few steps here: the 1,000-step sweep takes minutes."""

import json
import subprocess
import sys

import pytest
from e2e import ROOT

from distlib.app.config.run import RunConfig
from distlib.app.model import families
from distlib.launch.hydra_config import compose_tree

pytestmark = pytest.mark.slow


def _sweep(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "sweep.json"
    proc = subprocess.run(
        [sys.executable, "scripts/preset_sweep.py", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, json.loads(out.read_text()) if out.exists() else {}


def test_named_presets_train_whatever_their_size_and_are_counted_from_the_models(tmp_path):
    """Two named presets, both over a --max-params that applies only to the presets not named."""
    proc, d = _sweep(tmp_path, "--steps", "3", "--presets", "gpt2", "llama_tiny", "--max-params", "1")
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-2500:]
    assert d["steps"] == 3 and d["overrides"] == [] and d["left_out"] == {}
    assert [r["preset"] for r in d["runs"]] == ["gpt2", "llama_tiny"]
    for r in d["runs"]:
        model = RunConfig.from_dict(compose_tree([f"model={r['preset']}"])).model
        assert r["params"] == sum(p.numel() for p in families.build(model, 0).parameters())
        assert (r["exit"], r["trips"], r["status"], r["steps"]) == (0, 0, "completed", 3)
        assert 0 < r["lowest"] <= min(r["first"], r["last"]) and r["seconds"] > 0
    assert "2 of 2 presets trained 3 steps without a guard trip" in proc.stdout


def test_a_guard_trip_is_counted_and_fails_the_sweep(tmp_path):
    """A NaN gradient at step 2 trips the guard once (the run rolls back and completes)."""
    args = ["--steps", "3", "--presets", "gpt2", "--set", "fault.nan_grad_rank=0", "fault.nan_grad_step=2"]
    proc, d = _sweep(tmp_path, *args)
    assert proc.returncode == 1, proc.stdout[-1500:] + proc.stderr[-2500:]
    (run,) = d["runs"]
    assert (run["exit"], run["trips"], run["status"]) == (0, 1, "completed"), run
    assert "0 of 1 presets trained 3 steps without a guard trip" in proc.stdout


def test_an_unknown_preset_is_one_line(tmp_path):
    proc, d = _sweep(tmp_path, "--presets", "llama_huge")
    assert proc.returncode == 1 and d == {}
    there = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml") if p.stem != "minigpt")
    assert proc.stderr.strip().splitlines() == [
        f"--presets: no preset ['llama_huge'] in conf/model/ (there are {', '.join(there)})"
    ]
