"""The whole run's configuration: the groups together, and the rules between them.

``RunConfig.from_dict(tree)`` is the one place a configuration is checked: each group checks its
own keys as it is built (``schema``), then ``_check_across`` the rules that span groups. Hydra
composes the tree (train.py); ``distlib.launch.hydra_config`` registers these dataclasses'
defaults with Hydra, so conf/ holds only what a choice changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from distlib.app.config import layout_rules
from distlib.app.config.groups import (
    BYTE_VOCAB,
    ROTARY,
    DataConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
    ZeroConfig,
)
from distlib.app.config.operation import CheckpointConfig, DistConfig, GuardConfig
from distlib.app.config.schema import ConfigError, Group, key, specs
from distlib.app.runtime import devices
from distlib.app.runtime.faults import FaultConfig
from distlib.comm.layout import Layout, LayoutError

__all__ = ["ConfigError", "RunConfig", "GROUPS"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.dtype -> parameter/compute dtype
MAX_SYNTHETIC_VOCAB = 65535

# group name -> its dataclass, in the order of conf/config.yaml
GROUPS = {
    "model": ModelConfig,
    "optimizer": OptimizerConfig,
    "zero": ZeroConfig,
    "checkpoint": CheckpointConfig,
    "train": TrainConfig,
    "dist": DistConfig,
    "guard": GuardConfig,
    "fault": FaultConfig,
    "metrics": MetricsConfig,
    "data": DataConfig,
}


@dataclass(frozen=True)
class RunConfig(Group):
    """The whole run's configuration: the groups, and the top-level keys.

    seed: seed of the model initialisation and of the data order (the corpus has its own, data.seed)
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    seed: int = key(1234, ge=0)

    @property
    def layout(self) -> Layout:
        """The parallel layout of dist.world_size ranks (distlib/comm/layout.py: the rank order)."""
        d = self.dist
        return Layout.of(d.world_size, tp=d.tp, pp=d.pp, cp=d.cp, ep=d.ep)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: what the layout leaves of the world after dist.tp and dist.pp."""
        return self.layout.dp

    @property
    def global_batch(self) -> int:
        t = self.train
        return t.global_batch if t.global_batch is not None else t.batch_size * self.dp_size * t.grad_accum

    @property
    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.train.dtype]

    def device(self, local_rank: int) -> str:
        """Where this rank's tensors live (``devices.rank_device``)."""
        return devices.rank_device(self.train.device, self.dist.backend, local_rank)

    def departures(self) -> list[str]:
        """The keys deciding the capstone's loss curve (its model, data, optimizer, seed, batch and
        dtype: ``CAPSTONE_KEYS``) that this run sets away from their defaults. Layout keys (dist,
        zero, accumulation, checkpoints, metrics, guard, faults) change no step's data or update."""
        plain = RunConfig()
        return [
            f"{group}.{name}" if group else name
            for group, names in CAPSTONE_KEYS.items()
            for name in names or [s.name for s in specs(type(getattr(self, group)))]
            if _value(self, group, name) != _value(plain, group, name)
        ]

    @property
    def verifies_resume(self) -> bool:
        """checkpoint.verify_resume, or when null (the default) whether this run is the capstone's."""
        chosen = self.checkpoint.verify_resume
        return chosen if chosen is not None else not self.departures()

    @staticmethod
    def from_dict(tree: dict) -> RunConfig:
        """The checked configuration of a composed tree (Hydra's own ``hydra`` node is ignored)."""
        tree = {k: v for k, v in tree.items() if k != "hydra"}
        unknown = sorted(set(tree) - set(GROUPS) - {"seed"})
        if unknown:
            raise ConfigError(f"unknown top-level config key(s): {unknown}")
        groups = {name: cls.from_dict(tree.get(name)) for name, cls in GROUPS.items()}
        cfg = RunConfig(**groups, **({"seed": tree["seed"]} if "seed" in tree else {}))
        _check_across(cfg)
        return cfg


# group -> the keys of it that decide the capstone's loss curve (None: all of them); "" the top level
CAPSTONE_KEYS = {
    "model": None,
    "data": None,
    "optimizer": None,
    "train": ("global_batch", "batch_size", "dtype"),
    "": ("seed",),
}


def _value(cfg: RunConfig, group: str, name: str):
    return getattr(getattr(cfg, group) if group else cfg, name)


def _check_across(cfg: RunConfig) -> None:
    """The rules that span groups, each naming the keys involved."""
    d, m, t = cfg.dist, cfg.model, cfg.train
    try:
        cfg.layout  # noqa: B018 - built to be checked
    except LayoutError as exc:
        raise ConfigError(f"invalid parallel layout: {exc}") from exc
    check_tensor_parallel(m, d.tp)
    _check_batch(cfg)
    _check_pipeline(cfg)
    layout_rules.check_context(cfg)
    layout_rules.check_sequence(cfg)
    layout_rules.check_experts(cfg)
    _check_devices(cfg)
    opt = cfg.optimizer
    if opt.warmup_steps + opt.decay_steps > t.steps:
        raise ConfigError(f"optimizer.warmup_steps + optimizer.decay_steps exceed train.steps={t.steps}")
    _check_data(cfg)
    cfg.fault.check_run(d.world_size, t.steps, cfg.zero.overlap)


def check_tensor_parallel(m: ModelConfig, tp: int) -> None:
    """Every dimension tensor parallelism splits divides by ``tp``: the attention heads, (llama,
    mixtral) the key/value heads, the MLP's (each expert's) hidden units (``model.families.shard_model_``
    checks the same)."""
    splits = [("model.n_heads", m.n_heads, "attention heads")]
    if m.family in ROTARY:
        splits.append(("model.n_kv_heads", m.kv_heads, "key/value heads"))
    width = "model.mlp_hidden" if m.mlp_hidden is not None else "the MLP width model.mlp_ratio x model.dim"
    splits.append((width, m.mlp_width, "MLP hidden units"))
    for name, value, what in splits:
        if value % tp:
            raise ConfigError(
                f"invalid parallel layout: dist.tp={tp} must divide {name}={value} ({what} are split "
                f"across tensor-parallel ranks)"
            )


def _check_batch(cfg: RunConfig) -> None:
    t, ranks, d = cfg.train, cfg.dp_size, cfg.dist
    where = (
        f"dist.world_size/(dist.tp x dist.pp x dist.cp)={d.world_size}/({d.tp} x {d.pp} x {d.cp})="
        f"{ranks} data-parallel"
        if d.cp > 1
        else f"dist.world_size={ranks}"
        if d.tp == d.pp == 1
        else f"dist.world_size/dist.tp={d.world_size}/{d.tp}={ranks} data-parallel"
        if d.pp == 1
        else f"dist.world_size/(dist.tp x dist.pp)={d.world_size}/({d.tp} x {d.pp})={ranks} data-parallel"
    )
    if cfg.global_batch % (ranks * t.grad_accum):
        raise ConfigError(
            f"train.global_batch={cfg.global_batch} does not divide into {where} rank(s) x "
            f"train.grad_accum={t.grad_accum} micro-batch(es); use a multiple of {ranks * t.grad_accum}"
        )
    derived = cfg.global_batch // (ranks * t.grad_accum)
    if t.batch_size is not None and t.batch_size != derived:
        raise ConfigError(
            f"train.batch_size={t.batch_size} contradicts train.global_batch={cfg.global_batch} / "
            f"({where} x train.grad_accum={t.grad_accum}) = {derived}; set only one of them "
            f"(train.global_batch=null to size the batch per rank)"
        )


def _check_pipeline(cfg: RunConfig) -> None:
    d = cfg.dist
    if d.pp == 1:
        return
    chunks = d.pp * d.pp_virtual
    if cfg.model.n_layers % chunks:
        raise ConfigError(
            f"model.n_layers={cfg.model.n_layers} does not split into dist.pp x dist.pp_virtual = "
            f"{d.pp} x {d.pp_virtual} = {chunks} equal pipeline chunks"
        )
    if d.pp_schedule == "interleaved" and cfg.train.grad_accum % d.pp:
        raise ConfigError(
            f"dist.pp_schedule=interleaved needs train.grad_accum (micro-batches, "
            f"{cfg.train.grad_accum}) to be a multiple of dist.pp={d.pp}"
        )
    if cfg.model.tie_embeddings:
        raise ConfigError(
            f"model.tie_embeddings=true is not supported with dist.pp={d.pp}: the first stage's embedding "
            f"and the last stage's LM head would be one weight on two ranks; set model.tie_embeddings=false "
            f"or dist.pp=1"
        )
    if cfg.train.eval_every:
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every} is not supported with dist.pp={d.pp} "
            f"(the held-out loss runs the whole model on one rank); set train.eval_every=0"
        )


def _check_devices(cfg: RunConfig) -> None:
    backend, device = cfg.dist.backend, cfg.train.device
    if backend == "nccl" and not devices.cuda_devices():
        # Without this check the run would die later, as a rendezvous "timeout".
        raise ConfigError(
            f"dist.backend=nccl needs CUDA GPUs but {devices.no_cuda_reason()}; use dist.backend=gloo"
        )
    if device == "cuda" and not devices.cuda_devices():
        raise ConfigError(f"train.device=cuda but {devices.no_cuda_reason()}; use train.device=cpu")
    if backend == "nccl" and device == "cpu":
        raise ConfigError(
            "dist.backend=nccl moves CUDA tensors only, but train.device=cpu; use "
            "train.device=cuda (or auto), or dist.backend=gloo"
        )


def _check_data(cfg: RunConfig) -> None:
    d, m = cfg.data, cfg.model
    if d.kind == "synthetic":
        if d.total_tokens < m.seq_len + 1:
            raise ConfigError(f"data.total_tokens ({d.total_tokens}) must exceed model.seq_len ({m.seq_len})")
        if m.vocab_size > MAX_SYNTHETIC_VOCAB:
            raise ConfigError(
                f"model.vocab_size={m.vocab_size}: the synthetic corpus has at most "
                f"{MAX_SYNTHETIC_VOCAB} tokens"
            )
    elif m.vocab_size != tokenizer_vocab(d):
        fix = (
            "model.init_from's model must have that vocabulary"
            if m.init_from
            else "leave model.vocab_size out: it follows the tokenizer"
        )
        raise ConfigError(
            f"data.tokenizer={d.tokenizer} has {tokenizer_vocab(d)} tokens but model.vocab_size="
            f"{m.vocab_size}; {fix}"
        )
    if cfg.train.eval_every and d.val_fraction <= 0:
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every} needs held-out data: set "
            f"data.val_fraction > 0 (e.g. 0.1)"
        )


def tokenizer_vocab(data: DataConfig) -> int | None:
    """How many tokens ``data``'s tokenizer has (text: 256 bytes, or data.vocab_size with bpe);
    None for the synthetic corpus, which draws from the model's vocabulary."""
    if data.kind != "text":
        return None
    return data.vocab_size if data.tokenizer == "bpe" else BYTE_VOCAB


def with_tokenizer_vocab(tree: dict, typed: set[str]) -> dict:
    """``tree`` (as composed) with model.vocab_size the tokenizer's, unless ``typed`` (the dotted keys
    the run sets, or took from model.init_from) holds it: the model's vocabulary is not asked again.
    A data group that does not check is left as it is, for ``from_dict`` to name its key."""
    if "model.vocab_size" in typed:
        return tree
    try:
        vocab = tokenizer_vocab(DataConfig.from_dict(tree.get("data")))
    except ConfigError:
        return tree
    if vocab is None:
        return tree
    return {**tree, "model": {**(tree.get("model") or {}), "vocab_size": vocab}}
