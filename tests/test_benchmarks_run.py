"""The benchmarks still run (they import the library directly, so a refactor can break them
without any other test noticing). Tiny settings: this checks that they work, not their numbers;
startup.py and scaling.py are left to `make bench` (minutes each)."""
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
    "step": ["benchmarks/step.py", "--models", "tiny", "--worlds", "2", "--steps", "2", "--warmup", "1",
             "--stages", "1", "3", "--torch", "ddp"],
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_benchmark_runs_and_writes_its_json(name, tmp_path):
    # step.py takes --out; the others write benchmarks/results/<name>.json
    out = tmp_path / f"{name}.json" if name == "step" else ROOT / "benchmarks" / "results" / f"{name}.json"
    before = out.stat().st_mtime_ns if out.exists() else None
    args = RUNS[name] + (["--out", str(out)] if name == "step" else [])
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-2500:]
    assert out.stat().st_mtime_ns != before and json.loads(out.read_text()), f"{name} wrote no result"
