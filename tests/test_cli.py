"""Hydra overrides: bad values fail fast with a clear message; sweeps run one job per value."""

import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from e2e import ROOT, run, train

from distlib.app.config.run import ConfigError, RunConfig
from distlib.launch.hydra_config import compose_tree


def _compose(*overrides):
    return compose_tree(list(overrides))


def test_default_config_is_the_capstone():
    cfg = RunConfig.from_dict(_compose())
    assert (
        cfg.model.n_layers,
        cfg.model.dim,
        cfg.model.n_heads,
        cfg.model.vocab_size,
        cfg.model.seq_len,
    ) == (2, 32, 4, 64, 16)
    assert (
        cfg.train.steps,
        cfg.global_batch // cfg.dist.world_size,
        cfg.dist.world_size,
        cfg.zero.stage,
    ) == (20, 4, 4, 1)
    assert cfg.checkpoint.every_steps == 10 and cfg.dist.backend == "gloo"


@pytest.mark.parametrize(
    "override, message",
    [
        ("zero.stage=7", "zero.stage must be one of"),
        ("dist.world_size=0", "dist.world_size must be an integer >= 1"),
        ("model.dim=30", r"model.dim \(30\) must be divisible by model.n_heads \(4\)"),
        ("train.global_batch=10", "does not divide"),
        ("train.batch_size=3", "contradicts train.global_batch"),
        ("+model.colour=red", "unknown key"),
    ],
)
def test_bad_values_are_refused_with_the_key_named(override, message):
    tree = _compose(override)
    with pytest.raises((ConfigError, ValueError), match=message):
        cfg = RunConfig.from_dict(tree)
        from distlib.app.data.batches import BatchPlan

        BatchPlan(cfg.global_batch, cfg.dist.world_size, cfg.train.grad_accum)


@pytest.mark.skipif(
    torch.cuda.device_count() > 0, reason="this machine has a GPU: NCCL is a valid choice here"
)
def test_nccl_without_cuda_is_one_config_error(tmp_path):
    """NCCL moves CUDA tensors only (before this check: a 60 s "rendezvous did not form")."""
    proc = train(tmp_path, "dist.backend=nccl", "dist.world_size=1", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert (
        "config error: dist.backend=nccl needs CUDA GPUs but this machine has no usable CUDA GPU"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr and "rendezvous" not in proc.stderr


def test_an_unexpected_worker_error_is_printed_with_its_rank(tmp_path, own_tmp):
    """An unexpected exception in a worker is a bug: `python train.py` names the failed rank and
    prints that rank's traceback (torch's agent records it), not only "training failed"."""
    inject = tmp_path / "inject"
    inject.mkdir()
    # the workers are interpreters of their own: each imports this first (PYTHONPATH is inherited)
    (inject / "sitecustomize.py").write_text(
        "from distlib.app import trainer\n"
        "def broken(self):\n"
        "    raise RuntimeError(f'injected bug on rank {self.comm.rank}')\n"
        "trainer.Trainer.run = broken\n"
    )
    env = {"PYTHONPATH": f"{inject}:{ROOT}", "TMPDIR": str(own_tmp)}
    proc = run(
        [sys.executable, "train.py", "dist.world_size=2", f"hydra.run.dir={tmp_path / 'run'}"], 120, env
    )
    assert proc.returncode == 1
    assert not list(own_tmp.glob("torchelastic_*"))  # the agent's error files, read and removed
    summary = re.search(r"error: training failed: (.*)", proc.stderr)
    assert summary, proc.stderr[-2000:]
    failed = {int(r) for r in re.findall(r"rank (\d) \(exit", summary.group(1))}
    # a failed rank's own traceback follows (the one the agent recorded first; the launcher stops
    # the others after the first failure, so which rank that is varies)
    shown = {int(r) for r in re.findall(r"RuntimeError: injected bug on rank (\d)", proc.stderr)}
    assert shown & failed, proc.stderr[-2000:]


def test_a_run_leaves_nothing_in_the_temporary_directory(tmp_path, own_tmp):
    """The launcher's agent keeps its workers' error files in a directory of its own (torch's
    default: a new /tmp/torchelastic_* per launch, never removed), removed when the run ends; so is
    everything else (a real interpreter: a fork's temporary files are tests/forkrun.py's)."""
    args = ["dist.world_size=2", "train.steps=1", "checkpoint.every_steps=0", f"hydra.run.dir={tmp_path}"]
    proc = run([sys.executable, "train.py", *args], 120, {"TMPDIR": str(own_tmp)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not list(own_tmp.iterdir())


@pytest.fixture
def own_tmp():
    """A temporary directory of the test's own with a short path (removed after): multiprocessing's
    forkserver puts its socket there, and a socket's path has at most 107 bytes (pytest's tmp_path
    can be longer)."""
    own = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    yield own
    shutil.rmtree(own, ignore_errors=True)


def test_a_temporary_directory_too_long_for_a_socket_is_one_line(tmp_path, own_tmp):
    """The workers' fork server listens on a socket in the temporary directory, whose path has at
    most 107 bytes: a longer TMPDIR is one line before anything starts, not Python's "AF_UNIX path
    too long" traceback once the run has begun."""
    deep = own_tmp / ("d" * 80)
    deep.mkdir()
    proc = run([sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'run'}"], 60, {"TMPDIR": str(deep)})
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: the temporary directory {deep} (TMPDIR) is ")
    assert "use a directory of at most 75 bytes" in proc.stderr and not (tmp_path / "run").exists()


def _tree_bytes(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_refused_fresh_run_touches_nothing(tmp_path):
    """A fresh run into a directory holding checkpoints is refused before any file is written
    (Hydra's .hydra/config.yaml and overrides.yaml used to be rewritten first)."""
    first = train(tmp_path, "dist.world_size=1", "train.steps=2", "checkpoint.every_steps=1", timeout=120)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / ".hydra" / "overrides.yaml").exists()  # written for a run that starts
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    before = _tree_bytes(tmp_path)
    again = train(tmp_path, "dist.world_size=1", "train.steps=3", "checkpoint.every_steps=3", timeout=120)
    assert again.returncode == 1
    assert (
        "already holds checkpoint(s) up to step_00000002; pass checkpoint.resume=latest" in again.stderr
    )  # the newest
    assert "Traceback" not in again.stderr
    assert _tree_bytes(tmp_path) == before  # metrics.jsonl included


def test_a_choice_of_a_file_conf_does_not_hold_is_one_line(tmp_path):
    proc = train(tmp_path / "run", "model=nonexistent", timeout=60)
    names = ", ".join(sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"config error: model=nonexistent: conf/model/ has no nonexistent.yaml; model is one of {names}"
    ]
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run directory


def test_bad_override_on_the_command_line_fails_fast(tmp_path):
    proc = train(tmp_path, "zero.stage=7", timeout=60)
    assert proc.returncode == 2
    assert "config error: zero.stage must be one of" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_multirun_sweep_over_world_size(world_size_sweep):
    # README's sweep line (4 steps, a checkpoint at 2), run once for this test and
    # tests/test_readme_commands.py (conftest.py)
    proc, sweep = world_size_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and (p / "report.json").exists())
    assert [re.sub(r"^\d+_", "", j) for j in jobs] == ["ws1_zero1", "ws2_zero1", "ws4_zero1"]
    assert proc.stdout.count("RESUME VERIFIED") == 3


@pytest.mark.slow
def test_torchrun_world_size_contradicting_the_config_is_refused(tmp_path):
    from e2e import torchrun

    proc = torchrun(tmp_path, "dist.world_size=4", nproc=2, timeout=120)
    assert proc.returncode != 0
    assert "dist.world_size=4 but 2 processes were started" in proc.stderr


def test_a_rank_error_line_reaches_the_os_in_one_write(monkeypatch):
    """With stderr unbuffered (PYTHONUNBUFFERED, as under most launchers) print() writes a line's
    text and its newline apart, so two ranks failing at once could share a line (seen: rank 0's
    error appended to rank 2's, rank 0's name lost). rank_error hands the whole line over at once."""
    import io

    from distlib.launch.torchrun import rank_error

    class Raw(io.RawIOBase):
        def __init__(self):
            self.writes = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b))
            return len(b)

    raw = Raw()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, write_through=True))  # what -u sets up
    monkeypatch.setenv("RANK", "3")
    rank_error("step 3: rank 1 did not arrive")
    print("the old way", file=sys.stderr, flush=True)
    assert raw.writes == [b"error [rank 3]: step 3: rank 1 did not arrive\n", b"the old way", b"\n"]
