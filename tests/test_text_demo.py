"""`make text-demo`, shortened: a Llama with a BPE tokenizer trained on data/sample.txt at 4 ranks
with ZeRO-1, exported as a Hugging Face directory, and continued by transformers' own generate()."""

from __future__ import annotations

import subprocess

import pytest
from e2e import ROOT

pytestmark = pytest.mark.slow


def test_the_text_demo_trains_exports_and_transformers_generates(tmp_path):
    demo = tmp_path / "demo"
    proc = subprocess.run(
        ["make", "text-demo", f"TEXT_DEMO={demo}", "TEXT_STEPS=6"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "RESUME VERIFIED" in proc.stdout
    assert f"wrote {demo / 'hf'}: llama" in proc.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (demo / "hf").iterdir()}
    continued = [line for line in proc.stdout.splitlines() if line.startswith(("Rank zero", "Every rank"))]
    assert len(continued) == 2 and all(len(line.split()) > 2 for line in continued), proc.stdout[-1500:]
