"""The run configuration a checkpoint carries, checked by the rules a run's own goes through.

A manifest holds the model and data config of the run that wrote it (``Checkpointer._meta``).
Resuming, sampling and ``scripts/ckpt.py verify`` rebuild them with the config dataclasses, so a
hand-edited or foreign manifest (``"model": {"dim": -1}``) is refused with the key named, as the
same value on the command line would be. Keys an older version did not write take their defaults.
"""

from __future__ import annotations

from pathlib import Path

from distlib.app.config.data_group import DataConfig
from distlib.app.config.groups import ModelConfig
from distlib.checkpoint.sharded import CheckpointError


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
