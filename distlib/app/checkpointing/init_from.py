"""A fresh run's first weights from a Hugging Face model directory (``model.init_from``).

The directory's config.json is the model's architecture, as transformers' ``from_pretrained``
reads it: ``adopted`` (called by the launcher, before the configuration is checked, on a start
that is fresh) takes every key of ``ADOPTED`` the run does not set on purpose from it -- the
family and every key that fixes a shape or the arithmetic; dropout and activation checkpointing
stay the run's own; a text run (data=text) that names no tokenizer takes the directory's
tokenizer.json when it has one (data.tokenizer=DIR). A key the run does set must agree
(``hf_config.differences``; a shorter context is the run's to choose): ``check_source`` says
otherwise in one ConfigError naming the key and both values, before any worker starts. The
Checkpointer calls ``start_from`` on a fresh start only -- a resume, or a restart from a memory
snapshot, loads its checkpoint and never reads the directory (the run's record holds the adopted
keys).

``start_from`` is collective: every rank reads the directory (as every rank reads the data), cuts
its part out of the whole model's tensors -- its pipeline stage's parameters (the layout names
them), its tensor-parallel piece of each split one (``shard_of``), its data-parallel partition of
the flat vector -- and loads it as the optimizer's fp32 master weights with zero Adam moments and
step count 0, the state of a step-0 checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distlib.app.checkpointing.manifest_config import NO_RESUME
from distlib.app.config.data_group import TOKENIZER_JSON
from distlib.app.config.model_group import DEEPSEEK_KEYS, ModelConfig
from distlib.app.config.run import RunConfig
from distlib.app.config.schema import ConfigError
from distlib.app.model.bias_balance import STATE
from distlib.app.model.hf_config import HFError, differences, positions_for
from distlib.app.model.hf_weights import load_hf_dir, read_hf_config
from distlib.comm import agree
from distlib.comm.group import Comm
from distlib.parallel.adamw import STATE_KEYS
from distlib.parallel.tensor_parallel import Split, shard_of
from distlib.parallel.zero import ZeroOptimizer

# The model keys a directory's config.json gives (dropout, the MoE's router_aux_loss_coef and balance
# are the run's: training choices).
ADOPTED = (
    "family",
    "vocab_size",
    "seq_len",
    "dim",
    "n_heads",
    "n_layers",
    "mlp_ratio",
    "mlp_hidden",
    "n_kv_heads",
    "head_dim",
    "tie_embeddings",
    "norm_eps",
    "rope_theta",
    "n_experts",
    "top_k",
    "norm_topk_prob",
    *DEEPSEEK_KEYS,
)
_MLP_WIDTH = {"mlp_ratio", "mlp_hidden"}  # one width, two ways to write it: set one, both are the run's


def _fields(source: str) -> dict:
    try:
        return read_hf_config(source)
    except HFError as exc:
        raise ConfigError(f"model.init_from={source}: {exc}") from exc


def adopted(tree: dict, typed: set[str]) -> tuple[dict, set[str]]:
    """(``tree`` with the ``ADOPTED`` keys of ``model.init_from``'s config.json that the run does
    not set -- ``typed`` holds the dotted keys it does --, the dotted keys taken). Nothing is taken
    when the run sets another family: ``check_source`` names it. Reads config.json only; a
    directory that is no model is one ConfigError."""
    model = dict(tree.get("model") or {})
    if not model.get("init_from"):
        return tree, set()
    fields = _fields(model["init_from"])
    own = {k for k in ADOPTED if f"model.{k}" in typed}
    if "family" in own and model.get("family") != fields["family"]:
        return tree, set()
    own |= _MLP_WIDTH if own & _MLP_WIDTH else set()
    taken = {k: fields[k] for k in ADOPTED if k not in own and k in fields}
    tree, keys = {**tree, "model": {**model, **taken}}, {f"model.{k}" for k in taken}
    return _tokenizer_adopted(tree, typed, keys)


def _tokenizer_adopted(tree: dict, typed: set[str], keys: set[str]) -> tuple[dict, set[str]]:
    """A text run that names no tokenizer takes the directory's, when it has one: the ids its
    model was trained on (data.tokenizer=DIR)."""
    data, directory = dict(tree.get("data") or {}), Path(tree["model"]["init_from"]).expanduser()
    if data.get("kind") != "text" or "data.tokenizer" in typed or not (directory / TOKENIZER_JSON).is_file():
        return tree, keys
    return {**tree, "data": {**data, "tokenizer": str(directory)}}, keys | {"data.tokenizer"}


def _matching(model: ModelConfig, fields: dict) -> None:
    where = f"model.init_from={model.init_from}"
    if model.family != fields["family"]:
        raise ConfigError(
            f"{where} holds a {fields['family']} model but model.family={model.family}; leave the family "
            f"out (no model=... nor model.family=...) to take the directory's"
        )
    try:
        theirs = ModelConfig(**fields)
    except ConfigError as exc:
        raise ConfigError(
            f"{where}: its config.json gives a model config this program refuses: {exc}"
        ) from exc
    diff = differences(model, theirs)
    if diff:
        raise ConfigError(
            f"{where} disagrees with keys this run sets: {', '.join(diff)}; leave those keys out to take "
            f"the directory's values"
        )


def check(model: ModelConfig) -> None:
    """ConfigError unless ``model.init_from``'s config.json fits ``model`` (reads only that file)."""
    _matching(model, _fields(model.init_from))


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
    _check_biases(model, state)
    return positions_for(model, state)


def _check_biases(model: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """DeepSeek-V3's routers' correction biases choose experts: a run without selection biases
    (model.balance=aux) would route otherwise than the directory's model, unless they are zeros."""
    biased = [n for n in state if n.endswith(f".mlp.{STATE}") and state[n].any()]
    if biased and model.balance != "bias":
        raise ConfigError(
            f"model.init_from={model.init_from}: its routers' e_score_correction_bias are not zero, and "
            f"model.balance={model.balance} has no selection biases to keep them; set model.balance=bias"
        )


def start_from(
    model: ModelConfig,
    comm: Comm,
    optimizer: ZeroOptimizer,
    tp_splits: dict[str, Split],
    buffers: dict[str, torch.Tensor] | None = None,
) -> None:
    """Load ``model.init_from``'s weights as this rank's optimizer state (collective over ``comm``,
    the world: every rank raises the same ConfigError, or none does), and into ``buffers`` (this
    rank's model state buffers by name: DeepSeek-V3's selection biases) the directory's values."""
    state = agree.agreed(lambda: load(model), comm, ConfigError)
    for name, buffer in (buffers or {}).items():
        if name in state:  # (a Mixtral directory has none: its biases start at zero)
            buffer.copy_(state[name])
    shard = {}
    for held in optimizer.partitions():  # each flat layout this rank holds a partition of
        layout = held.layout
        flat = torch.zeros(layout.padded_numel)
        for slot in layout.slots:
            flat[slot.offset : slot.offset + slot.numel] = shard_of(
                state[slot.name], tp_splits.get(slot.name)
            ).reshape(-1)
        master = flat[slice(*layout.shard_range(held.rank))].clone()
        shard |= {held.prefix + k: master if k == "master" else torch.zeros_like(master) for k in STATE_KEYS}
    optimizer.load_state_shard(shard, 0)
