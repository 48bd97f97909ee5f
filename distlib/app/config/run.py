"""The whole run's configuration: the groups together, and the rules between them.

``RunConfig.from_dict(tree)`` is the one place a configuration is checked: each group checks its
own keys as it is built (``schema``), then ``_check_across`` the rules that span groups. Hydra
composes the tree (train.py); ``distlib.launch.hydra_config`` registers these dataclasses'
defaults with Hydra, so conf/ holds only what a choice changes.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from distlib.app.config import dimension_rules
from distlib.app.config.data_group import BYTE_VOCAB, DataConfig, id_range
from distlib.app.config.groups import MetricsConfig, OptimizerConfig, TrainConfig, ZeroConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.operation import CheckpointConfig, DistConfig, GuardConfig
from distlib.app.config.schema import ConfigError, Group, key, specs
from distlib.app.runtime import devices
from distlib.app.runtime.faults import FaultConfig
from distlib.comm.layout import DIMENSIONS, Layout, LayoutError

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
        return self.layout_of(self.dist.world_size)

    def layout_of(self, world_size: int) -> Layout:
        """This run's degrees over ``world_size`` ranks (the trainer's: those of the group it is given)."""
        return Layout.of(world_size, **{dim.name: self.degree(dim) for dim in DIMENSIONS})

    def degree(self, dim) -> int:
        """The degree this run sets for a layout dimension (``layout.DIMENSIONS``), by its config key."""
        group, name = dim.key.split(".")
        return getattr(getattr(self, group), name)

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
        cfg = RunConfig.groups_from_dict(tree)
        _check_across(cfg)
        return cfg

    @staticmethod
    def groups_from_dict(tree: dict) -> RunConfig:
        """A composed tree with each group's own keys checked, not yet the rules across groups
        (``from_dict``'s): a base for ``with_keys``, which the planner calls for each variant."""
        tree = {k: v for k, v in tree.items() if k != "hydra"}
        unknown = sorted(set(tree) - set(GROUPS) - {"seed"})
        if unknown:
            raise ConfigError(f"unknown top-level config key(s): {unknown}")
        groups = {name: cls.from_dict(tree.get(name)) for name, cls in GROUPS.items()}
        return RunConfig(**groups, **({"seed": tree["seed"]} if "seed" in tree else {}))

    def with_keys(self, changed: dict) -> RunConfig:
        """This configuration with dotted keys set (``{"dist.tp": 2}``), checked as ``from_dict``
        checks the tree they would be set in."""
        by_group: dict[str, dict] = {}
        for dotted, value in changed.items():
            group, name = dotted.split(".")
            by_group.setdefault(group, {})[name] = value
        groups = {group: _with(getattr(self, group), tuple(keys.items())) for group, keys in by_group.items()}
        cfg = dataclasses.replace(self, **groups)
        _check_across(cfg)
        return cfg


@functools.lru_cache(maxsize=1024)
def _with(group: Group, keys: tuple) -> Group:
    """``group`` with ``keys`` ((name, value) pairs) set and checked; a search sets the same few
    values again and again."""
    return dataclasses.replace(group, **dict(keys))


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


def _schedule_too_long(warmup: int, decay: int, steps: int) -> str:
    if not decay:
        return (
            f"optimizer.warmup_steps={warmup} exceeds train.steps={steps}: pass train.steps >= {warmup} "
            f"or a smaller optimizer.warmup_steps (a model preset may set it)"
        )
    return (
        f"optimizer.warmup_steps={warmup} + optimizer.decay_steps={decay} exceed train.steps={steps}: pass "
        f"train.steps >= {warmup + decay} or smaller ones (a model preset may set them)"
    )


def _check_across(cfg: RunConfig) -> None:
    """The rules that span groups, each naming the keys involved."""
    d, t = cfg.dist, cfg.train
    try:
        cfg.layout  # noqa: B018 - built to be checked
    except LayoutError as exc:
        raise ConfigError(f"invalid parallel layout: {exc}") from exc
    dimension_rules.check(cfg)
    _check_devices(cfg)
    opt = cfg.optimizer
    if opt.warmup_steps + opt.decay_steps > t.steps:
        raise ConfigError(_schedule_too_long(opt.warmup_steps, opt.decay_steps, t.steps))
    _check_data(cfg)
    cfg.fault.check_run(d.world_size, t.steps, cfg.zero.overlap)


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
    elif d.pretrained and m.vocab_size < tokenizer_vocab(d):
        raise ConfigError(
            f"data.tokenizer={d.tokenizer} has token ids up to {tokenizer_vocab(d) - 1} but model.vocab_size="
            f"{m.vocab_size}: the model's vocabulary must hold every id (a larger one is fine)"
        )
    elif not d.pretrained and m.vocab_size != tokenizer_vocab(d):
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
    """How many tokens ``data``'s tokenizer has (text: 256 bytes, data.vocab_size with bpe, or an
    existing tokenizer's id range); None for the synthetic corpus, which draws from the model's
    vocabulary."""
    if data.kind != "text":
        return None
    if data.pretrained:
        return id_range(data.tokenizer)
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
