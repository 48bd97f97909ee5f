"""The benchmarks still run (they import the library directly, so a refactor can break them
without any other test noticing). Tiny settings: this checks that they work, not their numbers;
startup.py and scaling.py are left to `make bench` (minutes each); recovery.py (two torchrun jobs)
runs in tests/test_memory_snapshot_e2e.py, which also checks its snapshot run's checkpoint."""

import json
import subprocess
import sys

import pytest
from e2e import ROOT

pytestmark = pytest.mark.slow

RUNS = {
    "checkpoint": ["benchmarks/checkpoint.py", "--params", "1e5", "--world-size", "2", "--repeats", "1"],
    "collectives": ["benchmarks/collectives.py", "--quick", "--sizes", "1024"],
    "pipeline": ["benchmarks/pipeline.py", "--quick"],
    # scripts/gpu_check.sh's step h (--model gpt2_124m) on the CPU, at the gpt2 preset's small shape
    "gpu_throughput": [
        "benchmarks/gpu_throughput.py",
        "--device",
        "cpu",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--warmup",
        "1",
        "--steps",
        "1",
    ],
    "step": [
        "benchmarks/step.py",
        "--models",
        "tiny",
        "--worlds",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--stages",
        "1",
        "3",
        "--torch",
        "ddp",
    ],
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_benchmark_runs_and_writes_its_json(name, tmp_path):
    # step.py takes --out, gpu_throughput.py --json; the others write benchmarks/results/<name>.json
    flag = {"step": "--out", "gpu_throughput": "--json"}.get(name)
    out = tmp_path / f"{name}.json" if flag else ROOT / "benchmarks" / "results" / f"{name}.json"
    before = out.stat().st_mtime_ns if out.exists() else None
    args = RUNS[name] + ([flag, str(out)] if flag else [])
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-2500:]
    assert out.stat().st_mtime_ns != before and json.loads(out.read_text()), f"{name} wrote no result"
    if name == "gpu_throughput":  # it benchmarked the preset it was given, not its default MiniGPT
        assert json.loads(out.read_text())["model"]["family"] == "gpt2"


def test_committed_cost_model_is_the_best_fit_to_the_committed_tables():
    """distlib/comm/cost_model.py's constants are what fit_cost_model.py finds on the committed
    --algos tables, and the docstring's "8% longer than the fastest" is its score."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/fit_cost_model.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2500:]
    best, committed = (
        line.split(" over the fastest")[0].split()[-1] for line in proc.stdout.splitlines()[:2]
    )
    assert best == committed == "0.082", proc.stdout
