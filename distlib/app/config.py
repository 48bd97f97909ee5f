"""Typed, validated run configuration built from the Hydra/OmegaConf tree.

Hydra composes ``conf/``; ``RunConfig.from_dict`` turns the result into frozen
dataclasses and rejects unknown keys and bad values with a message naming the
key, before any process is started.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from distlib.parallel.adamw import AdamWConfig
from distlib.comm.mesh import MeshError, check_layout
from distlib.app.lr_schedule import KEYS as SCHEDULE_KEYS, ScheduleConfig
from distlib.app.devices import DEVICES, cuda_devices, no_cuda_reason, rank_device
from distlib.app.model import ModelConfig, TPLayoutError, check_tp_layout
from distlib.app.unattended.guard_config import GuardConfig   # re-exported: the guard group
from distlib.app.checkpoint_config import CheckpointConfig   # re-exported: the checkpoint group
from distlib.app.tokens import BYTE_VOCAB
from distlib.app.dist_config import ConfigError, DistConfig, check_pipeline   # re-exported: the dist group


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}   # train.dtype -> parameter/compute dtype


@dataclass(frozen=True)
class OptimizerConfig:
    adamw: AdamWConfig
    grad_clip: float = 0.0
    schedule: ScheduleConfig = ScheduleConfig()   # the learning rate per step (lr_schedule.py)


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 1
    bucket_numel: int = 8192
    overlap: bool = False      # gradient sync from backward hooks on a comm thread; ZeRO-3 prefetch

    def __post_init__(self) -> None:
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"zero.overlap must be true or false, got {self.overlap!r}")
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero.stage must be one of 0, 1, 2, 3, got {self.stage!r}")
        if self.bucket_numel < 1:
            raise ConfigError(f"zero.bucket_numel must be >= 1, got {self.bucket_numel}")


@dataclass(frozen=True)
class DataConfig:
    kind: str = "synthetic"          # synthetic | text
    seed: int = 0                    # synthetic only
    total_tokens: int = 65536        # synthetic only
    follow_prob: float = 0.9         # synthetic only
    path: str | None = None          # text only: a UTF-8 file
    cache_dir: str | None = None     # text only: where the token file goes (null: next to the source)
    val_fraction: float = 0.0        # held-out tail of the tokens, never trained on

    def __post_init__(self) -> None:
        if self.kind not in ("synthetic", "text"):
            raise ConfigError(f"data.kind must be 'synthetic' or 'text', got {self.kind!r}")
        if not 0.0 <= self.follow_prob <= 1.0:
            raise ConfigError(f"data.follow_prob must be in [0, 1], got {self.follow_prob}")
        if self.kind == "text" and not self.path:
            raise ConfigError("data.kind=text needs data.path: the UTF-8 text file to train on")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    batch_size: int | None = None
    grad_accum: int = 1
    global_batch: int | None = 16
    loss_tolerance: float = 1e-6
    monotone_until_step: int = 20
    eval_every: int = 0          # validation loss every K steps; 0 = off
    eval_windows: int = 128      # held-out windows per evaluation
    dtype: str = "fp32"
    profile_steps: tuple[int, int] | None = None   # [a, b]: torch.profiler traces of steps a..b
    device: str = "auto"         # auto: cuda under dist.backend=nccl, else cpu

    def __post_init__(self) -> None:
        if self.profile_steps is not None:
            window = tuple(self.profile_steps) if isinstance(self.profile_steps, (list, tuple)) else ()
            if len(window) != 2 or not all(type(v) is int and 1 <= v <= self.steps for v in window) \
                    or window[0] > window[1]:
                raise ConfigError(f"train.profile_steps must be [a, b] with 1 <= a <= b <= train.steps={self.steps}, "
                                  f"got {self.profile_steps}")
            object.__setattr__(self, "profile_steps", window)
        if self.dtype not in DTYPES:
            raise ConfigError(f"train.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"train.device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and not cuda_devices():
            raise ConfigError(f"train.device=cuda but {no_cuda_reason()}; use train.device=cpu")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be >= 0 (0 disables), got {self.eval_every}")
        for name in ("steps", "grad_accum", "eval_windows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("batch_size", "global_batch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1 or null, got {getattr(self, name)}")
        if self.batch_size is None and self.global_batch is None:
            raise ConfigError("set train.global_batch or train.batch_size (both are null)")


SAVE_CRASH_POINTS = ("mid_shard", "before_manifest", "before_commit", "after_commit")


@dataclass(frozen=True)
class FaultConfig:
    """Faults injected on purpose, to prove the run survives or reports them (all None: no fault)."""
    kill_rank: int | None = None           # this rank SIGKILLs itself ...
    kill_at_step: int | None = None        # ... after finishing this step (first torchrun attempt only)
    crash_in_save: str | None = None       # every rank reaching this point of a save SIGKILLs itself
    disk_full_rank: int | None = None      # this rank's shard write fails with ENOSPC
    save_fault_step: int | None = None     # the save (by step) the two above hit; None: the first one
    lr_spike_step: int | None = None
    lr_spike_factor: float | None = None
    nan_grad_rank: int | None = None
    nan_grad_step: int | None = None
    hang_rank: int | None = None
    hang_step: int | None = None
    perturb_rank: int | None = None
    perturb_step: int | None = None
    perturb_param: str | None = None
    sigterm_rank: int | None = None
    sigterm_step: int | None = None
    slow_rank: int | None = None           # this rank sleeps in every step (after backward) ...
    slow_seconds: float | None = None      # ... this long: a straggler on purpose

    # (rank key, step key, smallest step): the step at which a rank-targeted fault fires
    RANKED = (("nan_grad_rank", "nan_grad_step", 1), ("hang_rank", "hang_step", 0),
              ("perturb_rank", "perturb_step", 1), ("sigterm_rank", "sigterm_step", 1))

    def __post_init__(self) -> None:
        if (self.kill_rank is None) != (self.kill_at_step is None):
            raise ConfigError("fault.kill_rank and fault.kill_at_step must be set together")
        if self.crash_in_save is not None and self.crash_in_save not in SAVE_CRASH_POINTS:
            raise ConfigError(f"fault.crash_in_save must be one of {list(SAVE_CRASH_POINTS)}, "
                              f"got {self.crash_in_save!r}")
        if (self.lr_spike_step is None) != (self.lr_spike_factor is None):
            raise ConfigError("fault.lr_spike_step and fault.lr_spike_factor must be set together "
                              f"(got step={self.lr_spike_step}, factor={self.lr_spike_factor})")
        if self.lr_spike_factor is not None and not self.lr_spike_factor > 0:
            raise ConfigError(f"fault.lr_spike_factor must be > 0, got {self.lr_spike_factor}")
        if self.lr_spike_step is not None and self.lr_spike_step < 1:
            raise ConfigError(f"fault.lr_spike_step must be >= 1, got {self.lr_spike_step}")
        for rank_key, step_key, first in self.RANKED:
            rank, step = getattr(self, rank_key), getattr(self, step_key)
            if (rank is None) != (step is None):
                raise ConfigError(f"fault.{rank_key} and fault.{step_key} must be set together "
                                  f"(got {rank_key}={rank}, {step_key}={step})")
            if rank is not None and rank < 0:
                raise ConfigError(f"fault.{rank_key} must be >= 0, got {rank}")
            if step is not None and step < first:
                raise ConfigError(f"fault.{step_key} must be >= {first}, got {step}")
        if (self.slow_rank is None) != (self.slow_seconds is None) or not (self.slow_seconds or 1) > 0:
            raise ConfigError(f"fault.slow_rank and fault.slow_seconds (> 0) must be set together "
                              f"(got slow_rank={self.slow_rank}, slow_seconds={self.slow_seconds})")
        if self.perturb_param is not None and self.perturb_rank is None:
            raise ConfigError("fault.perturb_param needs fault.perturb_rank and fault.perturb_step")

    @property
    def configured(self) -> bool:
        """Whether any fault is set (then a Trainer needs the ``Faults`` hooks attached)."""
        return any(v is not None for v in vars(self).values())

    def check_run(self, world_size: int, steps: int) -> None:
        """Faults must target an existing rank and a step the run reaches, or they test nothing."""
        for rank_key, step_key, _ in self.RANKED:
            rank, step = getattr(self, rank_key), getattr(self, step_key)
            if rank is not None and rank >= world_size:
                raise ConfigError(f"fault.{rank_key}={rank} but dist.world_size={world_size}")
            if step is not None and step > steps:
                raise ConfigError(f"fault.{step_key}={step} is beyond train.steps={steps}; it would never fire")
        if self.lr_spike_step is not None and self.lr_spike_step > steps:
            raise ConfigError(f"fault.lr_spike_step={self.lr_spike_step} is beyond train.steps={steps}; "
                              "it would never fire")


@dataclass(frozen=True)
class MetricsConfig:
    file: str = "metrics.jsonl"
    per_rank: bool = False
    progress_every: int = 1

    def __post_init__(self) -> None:
        if not self.file or "/" in self.file:
            raise ConfigError(f"metrics.file must be a plain file name in the run directory, got {self.file!r}")
        if self.progress_every < 0:
            raise ConfigError(f"metrics.progress_every must be >= 0 (0 disables), got {self.progress_every}")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(AdamWConfig()))
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    seed: int = 1234

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world divided into tensor-parallel groups of dist.tp and
        pipeline stages of dist.pp."""
        return self.dist.world_size // (self.dist.tp * self.dist.pp)

    @property
    def global_batch(self) -> int:
        t = self.train
        return t.global_batch if t.global_batch is not None else t.batch_size * self.dp_size * t.grad_accum

    @property
    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.train.dtype]

    def device(self, local_rank: int) -> str:
        """Where this rank's tensors live (``devices.rank_device``)."""
        return rank_device(self.train.device, self.dist.backend, local_rank)

    def _check_batch(self) -> None:
        t, ranks = self.train, self.dp_size
        d = self.dist
        where = (f"dist.world_size={ranks}" if d.tp == d.pp == 1 else
                 f"dist.world_size/dist.tp={d.world_size}/{d.tp}={ranks} data-parallel" if d.pp == 1 else
                 f"dist.world_size/(dist.tp x dist.pp)={d.world_size}/({d.tp} x {d.pp})={ranks} data-parallel")
        if self.global_batch % (ranks * t.grad_accum):
            raise ConfigError(
                f"train.global_batch={self.global_batch} does not divide into {where} rank(s) x "
                f"train.grad_accum={t.grad_accum} micro-batch(es); use a multiple of {ranks * t.grad_accum}")
        derived = self.global_batch // (ranks * t.grad_accum)
        if t.batch_size is not None and t.batch_size != derived:
            raise ConfigError(
                f"train.batch_size={t.batch_size} contradicts train.global_batch={self.global_batch} / "
                f"({where} x train.grad_accum={t.grad_accum}) = {derived}; set only one of them "
                f"(train.global_batch=null to size the batch per rank)")

    @staticmethod
    def from_dict(tree: dict) -> "RunConfig":
        tree = {k: v for k, v in tree.items() if k != "hydra"}
        known = {f.name for f in dataclasses.fields(RunConfig)}
        unknown = sorted(set(tree) - known)
        if unknown:
            raise ConfigError(f"unknown top-level config key(s): {unknown}")
        optimizer = dict(tree.get("optimizer", {}))
        grad_clip = optimizer.pop("grad_clip", 0.0)
        schedule = {k: optimizer.pop(k) for k in SCHEDULE_KEYS if k in optimizer}
        if grad_clip < 0:
            raise ConfigError(f"optimizer.grad_clip must be >= 0 (0 disables), got {grad_clip}")
        cfg = RunConfig(
            model=_build(ModelConfig, "model", tree.get("model", {})),
            optimizer=OptimizerConfig(_build(AdamWConfig, "optimizer", optimizer), grad_clip,
                                      _build(ScheduleConfig, "optimizer", schedule)),
            zero=_build(ZeroConfig, "zero", tree.get("zero", {})),
            checkpoint=_build(CheckpointConfig, "checkpoint", tree.get("checkpoint", {})),
            data=_build(DataConfig, "data", tree.get("data", {})),
            train=_build(TrainConfig, "train", tree.get("train", {})),
            dist=_build(DistConfig, "dist", tree.get("dist", {})),
            guard=_build(GuardConfig, "guard", tree.get("guard") or {}),
            fault=_build(FaultConfig, "fault", tree.get("fault") or {}),
            metrics=_build(MetricsConfig, "metrics", tree.get("metrics") or {}),
            seed=int(tree.get("seed", 1234)),
        )
        try:
            check_layout(cfg.dist.world_size, cfg.dist.tp, cfg.dist.pp)
            check_tp_layout(cfg.model, cfg.dist.tp)
        except (MeshError, TPLayoutError) as exc:
            raise ConfigError(f"invalid parallel layout: {exc}") from exc
        cfg._check_batch()
        check_pipeline(cfg.dist, cfg.model.n_layers, cfg.train.grad_accum, cfg.train.eval_every)
        if cfg.optimizer.schedule.warmup_steps + cfg.optimizer.schedule.decay_steps > cfg.train.steps:
            raise ConfigError(f"optimizer.warmup_steps + optimizer.decay_steps exceed train.steps={cfg.train.steps}")
        if cfg.dist.backend == "nccl" and cfg.train.device == "cpu":
            raise ConfigError("dist.backend=nccl moves CUDA tensors only, but train.device=cpu; use "
                              "train.device=cuda (or auto), or dist.backend=gloo")
        cfg.fault.check_run(cfg.dist.world_size, cfg.train.steps)
        if cfg.zero.overlap and cfg.fault.nan_grad_rank is not None:
            raise ConfigError("fault.nan_grad_rank poisons the gradients after backward, but with zero.overlap "
                              "their sync has already started there; set zero.overlap=false for this drill")
        if cfg.data.kind == "synthetic" and cfg.data.total_tokens < cfg.model.seq_len + 1:
            raise ConfigError(f"data.total_tokens ({cfg.data.total_tokens}) must exceed model.seq_len "
                              f"({cfg.model.seq_len})")
        if cfg.data.kind == "text" and cfg.model.vocab_size != BYTE_VOCAB:
            raise ConfigError(f"data.kind=text uses the byte-level tokenizer ({BYTE_VOCAB} tokens) but "
                              f"model.vocab_size={cfg.model.vocab_size}; drop the override (data=text sets "
                              f"{BYTE_VOCAB}) or pass model.vocab_size={BYTE_VOCAB}")
        if cfg.train.eval_every and cfg.data.val_fraction <= 0:
            raise ConfigError(f"train.eval_every={cfg.train.eval_every} needs held-out data: set "
                              f"data.val_fraction > 0 (e.g. 0.1)")
        for key in ("kill_rank", "disk_full_rank", "slow_rank"):
            rank = getattr(cfg.fault, key)
            if rank is not None and not 0 <= rank < cfg.dist.world_size:
                raise ConfigError(f"fault.{key}={rank} is not a rank of dist.world_size={cfg.dist.world_size}")
        return cfg


def _build(cls, group: str, values: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) in config group '{group}': {unknown} (known: {sorted(names)})")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from exc
