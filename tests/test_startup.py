"""Start-up costs that once were paid on every rank and must not come back."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str) -> None:
    """Run ``code`` in a fresh interpreter at the repository root; its assertions must hold."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_train_module_pauses_the_collector_for_its_imports_only():
    # train.py's imports run with the collector off (their objects, frozen after, are never
    # scanned again); the run itself must get a working collector back.
    code = (
        "import gc, sys, torch\n"
        "assert gc.get_freeze_count() == 0 and gc.isenabled()\n"
        "import train\n"
        "assert gc.isenabled(), 'the collector was left off'\n"
        "frozen = gc.get_freeze_count()\n"
        "assert frozen > 100_000, f'{frozen} objects frozen: the imports were not'\n"
    )
    _python(code)


@pytest.mark.slow
def test_deterministic_kernels_are_on_without_importing_the_compiler():
    # torch.use_deterministic_algorithms imports torch._dynamo (~4 s per rank); train.py's
    # helper must flip the same ATen switch without it.
    code = (
        "import sys, torch\nfrom distlib.launch.torchrun import use_deterministic_kernels\n"
        "assert not torch.are_deterministic_algorithms_enabled()\n"
        "use_deterministic_kernels()\n"
        "assert torch.are_deterministic_algorithms_enabled(), 'deterministic mode is off'\n"
        "heavy = [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules]\n"
        "assert not heavy, f'imported {heavy}'\n"
    )
    _python(code)


def test_under_torchrun_only_rank0_composes_unless_hydra_prints(monkeypatch):
    from distlib.launch import torchrun as launch

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.setattr(launch, "UNDER_TORCHRUN", True)
    assert launch.rank0_composes(["train.py", "zero=stage0", "hydra.run.dir=/tmp/x"])
    for flag in ("--cfg", "--help", "-c", "--info"):  # Hydra prints instead of running: every rank does
        assert not launch.rank0_composes(["train.py", flag, "job"]), flag
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no store to share through
    assert not launch.rank0_composes(["train.py", "zero=stage0"])
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    monkeypatch.setattr(launch, "UNDER_TORCHRUN", False)  # python train.py: one Hydra run
    assert not launch.rank0_composes(["train.py", "zero=stage0"])


def test_train_module_does_not_import_hydra():
    # ranks other than 0 import train.py and never compose; Hydra is imported inside main()
    _python(
        "import sys, train; assert 'hydra' not in sys.modules, 'hydra'; "
        "assert 'omegaconf' not in sys.modules, 'omegaconf'"
    )


@pytest.mark.slow
def test_a_config_error_on_rank0_ends_the_torchrun_job_instead_of_leaving_the_others_waiting(tmp_path):
    from e2e import torchrun

    proc = torchrun(tmp_path, "optimizer.lr=-1", nproc=2, timeout=120)
    assert proc.returncode != 0
    assert "optimizer.lr must be a number > 0" in proc.stderr


@pytest.mark.slow
def test_a_whole_capstone_never_imports_the_compiler_in_any_process(capstone_run):
    """torch._dynamo (and what it drags in: torch._inductor, sympy) costs ~1.3 s per process and
    was imported by accident before (a parameter count built the model on the meta device, whose
    nn.init runs through torch's Python references). Every process of the session's capstone --
    torchrun's agent and the 4 workers -- logs each import it makes (PYTHONPROFILEIMPORTTIME)."""
    proc, _ = capstone_run
    assert proc.returncode == 0 and "RESUME VERIFIED" in proc.stdout, proc.stdout[-2000:]
    imports = [
        line.rpartition("|")[2].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert sum(name == "imported package" for name in imports) == 5  # one import log per process
    assert "torch" in imports and "distlib.app.trainer" in imports
    heavy = sorted(
        {
            name
            for name in imports
            if name.split(".")[0] == "sympy" or name.startswith(("torch._dynamo", "torch._inductor"))
        }
    )
    assert heavy == [], heavy
