"""A fresh run's first weights from a Hugging Face model directory (``model.init_from``).

The directory's config.json must describe this run's model (``hf_config.differences``: family and
every key that fixes a shape or the arithmetic; dropout and activation checkpointing are the run's
own); anything else is one ConfigError naming the differing keys. ``check_source`` looks at it
before any worker starts, on a run that cannot be a resume (``checkpoint.resume`` unset); the
Checkpointer calls ``start_from`` on a fresh start only -- a resume, or a restart from a memory
snapshot, loads its checkpoint and never reads the directory.

``start_from`` is collective: every rank reads the directory (as every rank reads the data), cuts
its part out of the whole model's tensors -- its pipeline stage's parameters (the layout names
them), its tensor-parallel piece of each split one (``shard_of``), its data-parallel partition of
the flat vector -- and loads it as the optimizer's fp32 master weights with zero Adam moments and
step count 0, the state of a step-0 checkpoint.
"""

from __future__ import annotations

import torch

from distlib.app.checkpointing.loader import NO_RESUME
from distlib.app.config.groups import ModelConfig
from distlib.app.config.run import RunConfig
from distlib.app.config.schema import ConfigError
from distlib.app.model.hf_config import HFError, differences
from distlib.app.model.hf_weights import load_hf_dir, read_hf_config
from distlib.comm import agree
from distlib.comm.group import Comm
from distlib.parallel.adamw import STATE_KEYS
from distlib.parallel.tensor_parallel import Split, shard_of
from distlib.parallel.zero import ZeroOptimizer


def _matching(model: ModelConfig, fields: dict) -> None:
    where = f"model.init_from={model.init_from}"
    try:
        theirs = ModelConfig(**fields)
    except ConfigError as exc:
        raise ConfigError(
            f"{where}: its config.json gives a model config this program refuses: {exc}"
        ) from exc
    diff = differences(model, theirs)
    if diff:
        raise ConfigError(
            f"{where} does not match this run's model config: {', '.join(diff)}; set those keys to the "
            f"directory's values"
        )


def check(model: ModelConfig) -> None:
    """ConfigError unless ``model.init_from``'s config.json describes ``model`` (reads only that file)."""
    try:
        fields = read_hf_config(model.init_from)
    except HFError as exc:
        raise ConfigError(f"model.init_from={model.init_from}: {exc}") from exc
    _matching(model, fields)


def check_source(cfg: RunConfig) -> None:
    """Before the workers start: a run that starts fresh for sure (``checkpoint.resume`` unset) from
    ``model.init_from`` gets a directory that fits (``checkpoint.resume=latest`` may resume: then the
    Checkpointer checks, only if it starts fresh)."""
    if cfg.model.init_from and cfg.checkpoint.resume in NO_RESUME:
        check(cfg.model)


def load(model: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole model's fp32 tensors (our names) from ``model.init_from``, after the config check."""
    try:
        fields, state = load_hf_dir(model.init_from)
    except HFError as exc:
        raise ConfigError(f"model.init_from={model.init_from}: {exc}") from exc
    _matching(model, fields)
    return state


def start_from(model: ModelConfig, comm: Comm, optimizer: ZeroOptimizer, tp_splits: dict[str, Split]) -> None:
    """Load ``model.init_from``'s weights as this rank's optimizer state (collective over ``comm``,
    the world: every rank raises the same ConfigError, or none does)."""
    state = agree.agreed(lambda: load(model), comm, ConfigError)
    layout = optimizer.layout
    flat = torch.zeros(layout.padded_numel)
    for slot in layout.slots:
        flat[slot.offset : slot.offset + slot.numel] = shard_of(
            state[slot.name], tp_splits.get(slot.name)
        ).reshape(-1)
    master = flat[optimizer.my_range].clone()
    shard = {key: master if key == "master" else torch.zeros_like(master) for key in STATE_KEYS}
    optimizer.load_state_shard(shard, 0)
