"""What a ZeRO optimizer saves and loads: this rank's partition of the fp32 (master, exp_avg,
exp_avg_sq), whatever the stage (at stage 0 a rank holds all of them and saves its partition), so
the on-disk format does not depend on the stage. ``ShardState`` is the part of ``StageOptimizer``
that a checkpoint talks to; a stage that holds its state otherwise overrides ``_mine`` and
``_load_state``."""

from __future__ import annotations

import torch

from distlib.parallel.adamw import STATE_KEYS
from distlib.parallel.flat_layout import Partition


class ShardState:
    """Checkpoint state of a ZeRO optimizer (``layout``, ``comm``, ``master``, ``exp_avg``,
    ``exp_avg_sq``, ``_publish_params`` and ``step_count`` are the optimizer's)."""

    def partitions(self) -> list[Partition]:
        """What this rank holds: its partition of the one flat layout, saved under STATE_KEYS."""
        return [Partition("", self.layout, self.comm.rank)]

    def _mine(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's partition of a gradient or state tensor (already one, except at stage 0)."""
        return t

    def state_views(self) -> dict[str, torch.Tensor]:
        """This rank's partition of (master, exp_avg, exp_avg_sq), live (an async save copies them)."""
        return {k: self._mine(getattr(self, k)) for k in STATE_KEYS}

    def state_shard(self) -> dict[str, torch.Tensor]:
        """This rank's partition of (master, exp_avg, exp_avg_sq), as fp32 host copies."""
        return {k: v.to("cpu", copy=True) for k, v in self.state_views().items()}

    @torch.no_grad()
    def load_state_shard(self, shard: dict[str, torch.Tensor], step_count: int) -> None:
        for key in STATE_KEYS:
            if shard[key].shape != (self.layout.shard_numel,) or shard[key].dtype != torch.float32:
                raise ValueError(
                    f"checkpoint tensor {key!r} has shape {tuple(shard[key].shape)} "
                    f"{shard[key].dtype}; expected ({self.layout.shard_numel},) float32"
                )
        for key in STATE_KEYS:
            self._load_state(key, shard[key])
        self._publish_params()
        self.step_count = step_count

    def _load_state(self, key: str, partition: torch.Tensor) -> None:
        self._mine(getattr(self, key)).copy_(partition)
