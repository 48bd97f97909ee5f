"""The run configuration a checkpoint carries, checked by the rules a run's own goes through.

A manifest holds the model and data config of the run that wrote it (``Checkpointer._meta``).
Resuming, sampling and ``scripts/ckpt.py verify`` rebuild them with the config dataclasses, so a
hand-edited or foreign manifest (``"model": {"dim": -1}``) is refused with the key named, as the
same value on the command line would be. Keys an older version did not write take their defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

from distlib.app.config.data_group import DataConfig
from distlib.app.config.model_group import ModelConfig
from distlib.checkpoint.sharded import MANIFEST, CheckpointError

NO_RESUME = (None, "", "none", "null")  # checkpoint.resume values that start fresh
# The data keys that say how the text became tokens: a resume takes them from the checkpoint (where
# the corpus lives, data.path and data.cache_dir, stays the run's own).
TOKENIZATION = ("kind", "tokenizer", "vocab_size", "text_field")


def manifest_config(manifest: dict, path: Path | str) -> tuple[ModelConfig, DataConfig | None]:
    """(model config, data config or None for a manifest without one) of the checkpoint at ``path``."""
    try:
        model = ModelConfig.from_dict(manifest.get("model"))
        data = DataConfig.from_dict(manifest["data_config"]) if "data_config" in manifest else None
    except (TypeError, ValueError) as exc:  # a ConfigError, or a value that is not an object
        raise CheckpointError(
            f"checkpoint {path}: the run configuration in its manifest is invalid: {exc}"
        ) from exc
    return model, data


def adopted(tree: dict, typed: set[str]) -> tuple[dict, set[str]]:
    """A run that resumes an explicit checkpoint (``checkpoint.resume=PATH``) takes from its manifest
    what the run does not set on purpose (``typed``: dotted keys): the model's config, the data keys
    of its tokenization, and the seed and global batch its data order continues with -- as a fresh
    run takes a model's shape from model.init_from's config.json, so a checkpoint resumes in a new
    run directory, at any layout, without any of them typed again.
    Returns (the tree, the dotted keys taken). Reads manifest.json only: a checkpoint that cannot be
    read, or whose recorded configuration is invalid, is left for the loader to name."""
    resume = (tree.get("checkpoint") or {}).get("resume")
    if resume in NO_RESUME or resume == "latest":
        return tree, set()
    try:
        manifest = json.loads((Path(resume) / MANIFEST).read_text())
        manifest_config(manifest, resume)  # an invalid one is the loader's to name, with the checkpoint
    except (OSError, ValueError, AttributeError, CheckpointError):
        return tree, set()
    model, data = manifest.get("model"), manifest.get("data_config")
    if not isinstance(model, dict):
        return tree, set()
    taken = {f"model.{k}": v for k, v in model.items() if f"model.{k}" not in typed}
    if isinstance(data, dict):
        taken |= {f"data.{k}": data[k] for k in TOKENIZATION if k in data and f"data.{k}" not in typed}
    position = manifest.get("data") if isinstance(manifest.get("data"), dict) else {}
    if "global_batch" in position and not typed & {"train.global_batch", "train.batch_size"}:
        taken["train.global_batch"] = position["global_batch"]  # the data order continues exactly
    out = {**tree, **{group: dict(tree.get(group) or {}) for group in ("model", "data", "train")}}
    for key, value in taken.items():
        group, name = key.split(".")
        out[group][name] = value
    if "seed" in manifest and "seed" not in typed:  # the data order's seed (the init is loaded)
        out["seed"], taken["seed"] = manifest["seed"], manifest["seed"]
    return out, set(taken)
