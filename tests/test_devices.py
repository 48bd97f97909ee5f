"""Device placement, proven on a CPU-only machine.

* Every factory call in the training path names its device: a run with torch's default device
  set to ``meta`` (where any tensor created without ``device=`` would land, and then fail at its
  first real use) and torch's factories refusing a call from distlib without ``device=`` (autograd
  hooks do not see the default device) trains bit for bit like the plain run, at every ZeRO stage
  and with tensor parallelism, checkpoint save, resume check and evaluation included; and every buffer of the
  optimizer is on the model's device afterwards.
* The two transports a GPU needs, exercised over gloo: staging every message through a buffer
  (what a CUDA tensor over gloo takes) and posting each round as one ``batch_isend_irecv``
  (what NCCL takes) give the same bytes as the plain path, for every collective and algorithm.
* The config rules of ``train.device`` and ``dist.backend=nccl``.
* A checkpoint as a GPU writes it (with ``rng.cuda``) loads on the CPU and continues exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import test_collectives as battery
import torch
from ckpt_util import assert_same_files, assert_same_state, saved_state, state_of
from multiproc import run_ranks

from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.runtime import devices
from distlib.app.trainer import Trainer
from distlib.checkpoint import relayout, rng_state, sharded
from distlib.comm import agree
from distlib.comm.group import Comm
from distlib.comm.p2p import P2P
from distlib.launch.torchrun import use_deterministic_kernels

MODEL = {"vocab_size": 30, "seq_len": 8, "dim": 16, "n_heads": 4, "n_layers": 2, "mlp_ratio": 2}


def _cfg(stage: int, tp: int = 1, resume: str | None = None, dtype: str = "fp32") -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": MODEL,
            "zero": {"stage": stage, "bucket_numel": 600},
            "data": {"total_tokens": 4096, "val_fraction": 0.1},
            "train": {
                "steps": 3,
                "global_batch": 8,
                "grad_accum": 2,
                "eval_every": 3,
                "eval_windows": 5,
                "dtype": dtype,
            },
            "dist": {"world_size": 2, "tp": tp},
            "guard": {"check_sync_every": 3},
            "checkpoint": {"every_steps": 2, "resume": resume},
        }
    )


def _run(comm, cfg: RunConfig, run_dir: Path, default_device: str | None, reload: bool = False):
    if comm.rank == 0:
        run_dir.mkdir(parents=True)
    use_deterministic_kernels()  # the product's switch: the same ATen flag, without torch._inductor
    agree.all_true(True, comm)
    read = relayout.load
    if default_device is not None:
        _strict_factories()
        torch.set_default_device(default_device)
        # safetensors' get_slice builds its tensor on the default device (not ours to place):
        # checkpoint reads run with the CPU as default, the rest of the run with ``default_device``.
        relayout.load = lambda *a, **k: _on_cpu(read, *a, **k)
    try:
        trainer = Trainer(cfg, comm, run_dir)
        result = trainer.run()
        reloaded = _reload(trainer, run_dir / "checkpoints" / "step_00000002") if reload else None
    finally:
        torch.set_default_device(None)
        relayout.load = read
    opt = trainer.optimizer
    buffers = {}
    for group, stage in opt.groups.items():  # each parameter group's stage optimizer
        buffers |= {
            f"{group}.{name}": t
            for name in ("flat_params", "flat_grads", "master", "exp_avg", "exp_avg_sq", "param_shard")
            if isinstance(t := getattr(stage, name, None), torch.Tensor)
        }
        if hasattr(stage, "grads"):
            buffers |= {f"{group}.grads.live[{i}]": t for i, t in enumerate(stage.grads.live())}
        buffers |= {f"{group}.unit[{i}]": t for i, t in enumerate(getattr(stage, "_unit_buffers", []))}
    assert any(k.endswith(".master") for k in buffers)  # the stage's state was found
    buffers |= {f"param {n}": p for n, p in trainer.model.named_parameters()}
    return {
        "losses": [s.loss.hex() for s in result.steps],
        "val": [s.val_loss for s in result.steps],
        "state": state_of(opt),
        "reloaded": reloaded,
        "devices": {k: str(t.device) for k, t in buffers.items()},
    }


def _reload(trainer: Trainer, ckpt: Path) -> dict:
    """``ckpt`` loaded as a resume (and the resume check) loads it, through the run's loader, into a
    model and optimizer built from another seed, under the run's default device; this rank's
    optimizer partition then."""
    model, optimizer = trainer._fresh_model()
    trainer.checkpointer.loader.load(ckpt, model, optimizer, restores_data=False)
    return state_of(optimizer)


FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint")
DISTLIB = str(Path(__file__).resolve().parents[1] / "distlib")


def _strict_factories() -> None:
    """Make torch's factory functions refuse a call from distlib without ``device=``. Autograd
    hooks (ZeRO-2/3 buckets, bf16 accumulation) run with the default-device mode switched off,
    so this is what covers them. (In a forked rank: the test process is untouched.)"""

    def strict(name, real):
        def factory(*args, **kwargs):
            caller = sys._getframe(1)
            if "device" not in kwargs and caller.f_code.co_filename.startswith(DISTLIB):
                raise AssertionError(
                    f"torch.{name} without device= at {caller.f_code.co_filename}:{caller.f_lineno}"
                )
            return real(*args, **kwargs)

        return factory

    for name in FACTORIES:
        setattr(torch, name, strict(name, getattr(torch, name)))


def _on_cpu(fn, *args, **kwargs):
    with torch.device("cpu"):
        return fn(*args, **kwargs)


def _default_meta(comm, root: str, layouts):
    out = []
    for stage, tp, dtype in layouts:
        cfg = _cfg(stage, tp, dtype=dtype)
        plain = _run(comm, cfg, Path(root) / f"plain{stage}{tp}{dtype}", None, reload=True)
        meta = _run(comm, cfg, Path(root) / f"meta{stage}{tp}{dtype}", "meta", reload=True)
        out.append((stage, tp, dtype, plain, meta))
    return out


@pytest.mark.slow
def test_no_tensor_of_a_training_run_is_created_on_the_default_device(tmp_path):
    layouts = [(0, 1, "fp32"), (1, 1, "bf16"), (2, 1, "fp32"), (3, 1, "fp32"), (1, 2, "fp32")]
    for rank, runs in enumerate(run_ranks(_default_meta, 2, str(tmp_path), layouts)):
        for stage, tp, dtype, plain, meta in runs:
            _assert_same_run(tmp_path, rank, f"{stage}{tp}{dtype}", plain, meta)


def _assert_same_run(root: Path, rank: int, name: str, plain: dict, meta: dict) -> None:
    """The meta-default run is the plain one: losses, final state and step-2 checkpoint, byte for
    byte; the checkpoint reloads (under each run's default device) to exactly what its shard holds;
    and every buffer is on the CPU."""
    where = f"{name}, rank {rank}"
    ckpts = [root / f"{kind}{name}" / "checkpoints" / "step_00000002" for kind in ("plain", "meta")]
    assert_same_files(*ckpts)
    for run, ckpt in zip((plain, meta), ckpts):
        assert_same_state(
            run["reloaded"], saved_state(ckpt, rank), f"{where}: reload of {ckpt.parent.parent.name}"
        )
    assert_same_state(meta["state"], plain["state"], where)
    assert meta["losses"] == plain["losses"] and meta["val"] == plain["val"], where
    assert set(meta["devices"].values()) == {"cpu"}, (where, meta["devices"])
    assert len(meta["devices"]) > 10, where


def _transport_battery(comm, mode: str):
    """test_collectives' battery (every collective, algorithm, size, dtype, op) in ``mode``."""
    if "batched" in mode:
        Comm.batched = property(lambda self: True)  # (a forked rank: the parent is untouched)
    if "staged" in mode:
        P2P.staged = lambda self, t: True
    return battery._battery_rank(comm)


@pytest.mark.slow
def test_staged_and_batched_messages_give_the_same_bytes():
    plain = run_ranks(_transport_battery, 3, "plain", timeout_s=120)
    for mode in ("staged", "batched"):
        got = run_ranks(_transport_battery, 3, mode, timeout_s=120)
        battery._assert_identical(got)
        assert got == plain, f"{mode}: results differ from the plain path"


def test_staging_copies_through_a_separate_buffer_and_back(monkeypatch):
    """The staged path really stages: the posted tensor is a copy, and a receive lands in the
    caller's tensor only after the wait (world of one: P2P's bookkeeping without a peer)."""
    posted = []
    monkeypatch.setattr(P2P, "staged", lambda self, t: True)
    monkeypatch.setattr("torch.distributed.isend", lambda t, peer, group=None: posted.append(t) or _Done())
    monkeypatch.setattr("torch.distributed.irecv", lambda t, peer, group=None: posted.append(t) or _Done(t))
    p2p = P2P("test", Comm(ranks=(0, 1), rank=0))
    src, dst = torch.arange(4.0), torch.zeros(4)
    handles = [p2p.send(src, 1), p2p.recv(dst, 1)]
    assert posted[0] is not src and torch.equal(posted[0], src)
    assert posted[1] is not dst and torch.equal(dst, torch.zeros(4))
    p2p.wait(*handles)
    assert torch.equal(dst, torch.full((4,), 7.0))


class _Done:
    def __init__(self, fill: torch.Tensor | None = None):
        self.fill = fill

    def wait(self):
        if self.fill is not None:
            self.fill.fill_(7.0)


# -- config rules -------------------------------------------------------------
def test_train_device_values_are_validated():
    with pytest.raises(
        ConfigError, match=r"train.device must be one of \['auto', 'cpu', 'cuda'\], got 'gpu'"
    ):
        RunConfig.from_dict({"train": {"device": "gpu"}})
    assert RunConfig.from_dict({}).device(3) == "cpu"  # auto + gloo: the CPU


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_config_error():
    with pytest.raises(ConfigError, match="train.device=cuda but this machine has no usable CUDA GPU"):
        RunConfig.from_dict({"train": {"device": "cuda"}})
    with pytest.raises(ConfigError, match="dist.backend=nccl needs CUDA GPUs but this machine has no usable"):
        RunConfig.from_dict({"dist": {"backend": "nccl"}})


def test_device_choice_with_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_devices", lambda: 2)
    nccl = RunConfig.from_dict({"dist": {"backend": "nccl"}})
    assert [nccl.device(r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    shared = RunConfig.from_dict({"train": {"device": "cuda"}})  # gloo, ranks share GPUs
    assert (shared.dist.backend, shared.device(3)) == ("gloo", "cuda:1")
    assert RunConfig.from_dict({"train": {"device": "cpu"}}).device(1) == "cpu"
    with pytest.raises(ConfigError, match="dist.backend=nccl moves CUDA tensors only, but train.device=cpu"):
        RunConfig.from_dict({"dist": {"backend": "nccl"}, "train": {"device": "cpu"}})


# -- checkpoints across devices -------------------------------------------------
def test_cpu_checkpoints_hold_no_cuda_rng_state():
    tensors, _ = rng_state.capture_rng("cpu")
    assert sorted(tensors) == ["rng.numpy_keys", "rng.torch"]


def _gpu_written_checkpoint(comm, root: str):
    """Train 3 steps saving at 2 with a capture_rng that also writes ``rng.cuda`` (as on a GPU),
    then resume from step 2 on the CPU: the same losses as the uninterrupted run."""
    real = rng_state.capture_rng

    def as_on_a_gpu(device="cpu"):
        tensors, meta = real(device)
        return {**tensors, "rng.cuda": torch.arange(16, dtype=torch.uint8)}, meta

    rng_state.capture_rng = as_on_a_gpu
    first = _run(comm, _cfg(1), Path(root) / "gpu", None)
    rng_state.capture_rng = real
    ckpt = Path(root) / "gpu" / "checkpoints" / "step_00000002"
    keys = sorted(sharded.load_shard(ckpt, comm.rank)[0])
    resumed = _run(comm, _cfg(1, resume=str(ckpt)), Path(root) / "cpu", None)
    return first, resumed, keys


def test_a_checkpoint_with_cuda_rng_state_resumes_on_the_cpu(tmp_path):
    first, resumed, keys = run_ranks(_gpu_written_checkpoint, 2, str(tmp_path))[0]
    assert "rng.cuda" in keys
    assert resumed["losses"] == first["losses"][2:] and len(resumed["losses"]) == 1
    assert_same_state(resumed["state"], first["state"], "step 3 after the resume vs without")
