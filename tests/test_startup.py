"""Start-up costs that once were paid on every rank and must not come back."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_deterministic_kernels_are_on_without_importing_the_compiler():
    # torch.use_deterministic_algorithms imports torch._dynamo (~4 s per rank); train.py's
    # helper must flip the same ATen switch without it.
    code = ("import sys, torch, train\n"
            "assert not torch.are_deterministic_algorithms_enabled()\n"
            "train.use_deterministic_kernels()\n"
            "assert torch.are_deterministic_algorithms_enabled(), 'deterministic mode is off'\n"
            "heavy = [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules]\n"
            "assert not heavy, f'imported {heavy}'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
