"""Start-up costs that once were paid on every rank and must not come back."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str) -> None:
    """Run ``code`` in a fresh interpreter at the repository root; its assertions must hold."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# Run in a fresh interpreter: train.py's imports (torch, distlib, ...) leave ~260,000 objects the
# collector tracks, nearly all of them live for the whole run.
PAUSED_COLLECTOR = """
import gc, importlib.util, sys, weakref
# `import train`, in two halves: the import machinery reads and compiles train.py (which may start
# a pass of its own), then train.py's body runs, where the imports are
spec = importlib.util.find_spec("train")
code, module = spec.loader.get_code("train"), importlib.util.module_from_spec(spec)
sys.modules["train"] = module
passes = []
gc.callbacks.append(lambda phase, info: phase == "start" and passes.append(info["generation"]))
exec(code, vars(module))
assert passes == [], f"{len(passes)} collection passes while train.py ran (generations {set(passes)})"
# what the imports made: every module but train's (its functions are defined after its imports)
# and this script's, the module's namespace and what that holds (functions, classes, ...)
modules = [m for m in sys.modules.values() if m not in (module, sys.modules[__name__])]
imported = {id(m) for m in modules} | {id(v) for m in modules for v in vars(m).values() if gc.is_tracked(v)}
made_after = [[]]
traversed = {id(o) for o in gc.get_objects()}  # what a full collection now walks
assert id(made_after) in traversed, "the run's own objects are collected"
walked = len(imported & traversed)
assert walked == 0, f"a full collection walks {walked} of the {len(imported)} objects the imports made"
# the collector runs by itself again: a reference cycle made now is freed by its passes
assert gc.isenabled(), "the collector was left off"
class Node: pass
cycle = Node(); cycle.me = cycle; gone = weakref.ref(cycle); del cycle
junk = [[] for _ in range(100_000)]  # allocations: generation-0 passes start on their own
assert passes and gone() is None, f"{len(passes)} passes, and the cycle survived"
"""


def test_the_collector_never_walks_train_pys_imports_yet_collects_the_runs_garbage():
    # Their passes over those objects took 0.45-0.65 s of each rank's start (train.py's comment); the
    # collector must not walk them, during the imports or after, and must still collect the run's garbage.
    _python(PAUSED_COLLECTOR)


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


@pytest.mark.slow
def test_recomputed_blocks_import_the_compiler_once_in_the_launcher_not_in_every_worker(tmp_path):
    """torch.utils.checkpoint imports torch._dynamo at a block's first recomputation (2.1 s a
    process); under `python train.py` the launcher imports it before forking the workers' server, so
    a 2-rank job imports it once. A fresh interpreter: the suite's own process has it imported."""
    proc = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={tmp_path}", "model.activation_checkpointing=blocks"]
        + ["dist.world_size=2", "train.steps=1", "checkpoint.every_steps=0"]
        + ["checkpoint.verify_resume=false"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # one import log per process forked or started; torch._dynamo.config is imported by every
    # process that imports torch._dynamo, and only once there
    imported = [line.rpartition("|")[2].strip() for line in proc.stderr.splitlines()]
    assert imported.count("torch._dynamo.config") == 1, imported.count("torch._dynamo.config")
