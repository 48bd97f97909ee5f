"""ZeRO: an AdamW step that shards optimizer state across data-parallel ranks.

All parameters live in one contiguous fp32 buffer (``FlatLayout``): parameter
``i`` is a view of ``flat_params[offset_i : offset_i + numel_i]`` and its
gradient a view of ``flat_grads`` at the same place, so a whole model's
gradients move in one collective. The buffer is padded to a multiple of the
world size N (fewer than N extra zeros), and rank r owns partition r.

``step()`` replaces ``optimizer.step()``; it is ``sync_grads()`` (which returns the
global grad norm) followed by ``apply_update(lr)``, so a caller can look at the
norm and the loss before deciding to update:

  stage 0  all-reduce grads (SUM / N); every rank runs AdamW on everything.
           Optimizer state 8P bytes (m, v); the fp32 params are the master.
  stage 1  reduce-scatter grads (SUM / N) -> this rank's grad partition;
           AdamW on the fp32 master partition; write it into the flat params;
           all-gather the params. Optimizer state 12P/N bytes (master, m, v).

Whatever the stage, a checkpoint holds partition r of (master, exp_avg,
exp_avg_sq) on rank r, so the on-disk format does not depend on the stage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from distlib import collectives
from distlib.adamw import AdamWConfig, adamw_step_
from distlib.comm import Comm

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter sits in the flat buffer, and how the buffer is partitioned."""
    slots: tuple[ParamSlot, ...]
    world_size: int

    @staticmethod
    def of(module: nn.Module, world_size: int) -> "FlatLayout":
        slots, offset = [], 0
        for name, p in module.named_parameters():
            slots.append(ParamSlot(name, tuple(p.shape), offset))
            offset += p.numel()
        return FlatLayout(tuple(slots), world_size)

    @property
    def numel(self) -> int:
        """P: the number of real (unpadded) parameters."""
        return sum(s.numel for s in self.slots)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def to_dict(self) -> dict:
        return {"numel": self.numel, "padded_numel": self.padded_numel, "padding": self.padded_numel - self.numel,
                "world_size": self.world_size, "shard_numel": self.shard_numel, "dtype": "float32",
                "params": [{"name": s.name, "shape": list(s.shape), "offset": s.offset, "numel": s.numel}
                           for s in self.slots]}

    @staticmethod
    def from_dict(d: dict) -> "FlatLayout":
        return FlatLayout(tuple(ParamSlot(p["name"], tuple(p["shape"]), p["offset"]) for p in d["params"]),
                          d["world_size"])


class ZeroOptimizer:
    """AdamW over a data-parallel group with ZeRO stage 0 or 1 sharding."""

    def __init__(self, module: nn.Module, comm: Comm, stage: int, cfg: AdamWConfig, grad_clip: float = 0.0):
        if stage not in (0, 1):
            raise ValueError(f"zero.stage must be one of 0, 1 for ZeroOptimizer, got {stage}")
        if grad_clip < 0:
            raise ValueError(f"optimizer.grad_clip must be >= 0 (0 disables), got {grad_clip}")
        self.module, self.comm, self.stage, self.cfg, self.grad_clip = module, comm, stage, cfg, grad_clip
        self.layout = FlatLayout.of(module, comm.size)
        self.step_count = 0
        self._synced: tuple[torch.Tensor, float] | None = None   # set by sync_grads, used by apply_update
        self.flat_params = torch.zeros(self.layout.padded_numel)
        self.flat_grads = torch.zeros(self.layout.padded_numel)
        with torch.no_grad():
            for slot, p in zip(self.layout.slots, module.parameters()):
                view = slice(slot.offset, slot.offset + slot.numel)
                self.flat_params[view].copy_(p.reshape(-1))
                p.data = self.flat_params[view].view(slot.shape)
                p.grad = self.flat_grads[view].view(slot.shape)
        start, end = self.layout.shard_range(comm.rank)
        self.my_range = slice(start, end)
        if stage == 0:
            self.master = self.flat_params  # fp32 params are their own master copy
            self.exp_avg = torch.zeros(self.layout.padded_numel)
            self.exp_avg_sq = torch.zeros(self.layout.padded_numel)
        else:
            self.master = self.flat_params[self.my_range].clone()
            self.exp_avg = torch.zeros(self.layout.shard_numel)
            self.exp_avg_sq = torch.zeros(self.layout.shard_numel)

    # -- the step -------------------------------------------------------------
    def zero_grad(self) -> None:
        """Clear the gradients (and drop synchronised ones that were never applied)."""
        self.flat_grads.zero_()
        self._synced = None

    @torch.no_grad()
    def step(self, lr: float | None = None) -> float:
        """Synchronise gradients, update, re-replicate params. Returns the global grad norm
        (of the rank-averaged gradient, before clipping)."""
        grad_norm = self.sync_grads()
        self.apply_update(lr)
        return grad_norm

    @torch.no_grad()
    def sync_grads(self) -> float:
        """First half of ``step``: average the gradients over ranks (this rank keeps what it
        updates) and return the global grad norm, identical on every rank. Nothing is updated
        yet, so a caller can still decide (e.g. the divergence guard) not to ``apply_update``."""
        if self.stage == 0:
            grads = collectives.all_reduce(self.flat_grads, self.comm, op="avg")
            partial_sq = torch.stack([grads[slice(*self.layout.shard_range(r))].pow(2).sum()
                                      for r in range(self.comm.size)])
        else:
            grads = collectives.reduce_scatter(self.flat_grads, self.comm, op="avg")
            partial_sq = torch.zeros(self.comm.size)
            collectives.all_gather(partial_sq, grads.pow(2).sum().reshape(1), self.comm)
        # Summing the per-partition squares in rank order gives every stage the same norm bits.
        grad_norm = float(partial_sq.sum().sqrt())
        self._synced = (grads, grad_norm)
        return grad_norm

    @torch.no_grad()
    def apply_update(self, lr: float | None = None) -> None:
        """Second half of ``step``: clip, AdamW on this rank's master, re-replicate the params."""
        if self._synced is None:
            raise RuntimeError("ZeroOptimizer.apply_update() needs sync_grads() first (once per update)")
        (grads, grad_norm), self._synced = self._synced, None
        if self.grad_clip > 0:
            # torch.nn.utils.clip_grad_norm_'s coefficient
            coef = min(self.grad_clip / (grad_norm + 1e-6), 1.0)
            if coef < 1.0:
                grads.mul_(coef)
        self.step_count += 1
        adamw_step_(self.master, grads, self.exp_avg, self.exp_avg_sq, self.step_count, self.cfg, lr)
        if self.stage == 1:
            self.flat_params[self.my_range].copy_(self.master)
            collectives.all_gather(self.flat_params, self.flat_params[self.my_range], self.comm)

    # -- state for checkpoints and reports --------------------------------------
    def _mine(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.my_range] if self.stage == 0 else t

    def state_shard(self) -> dict[str, torch.Tensor]:
        """This rank's partition of (master, exp_avg, exp_avg_sq), as copies."""
        return {k: self._mine(getattr(self, k)).clone() for k in STATE_KEYS}

    @torch.no_grad()
    def load_state_shard(self, shard: dict[str, torch.Tensor], step_count: int) -> None:
        for key in STATE_KEYS:
            if shard[key].shape != (self.layout.shard_numel,) or shard[key].dtype != torch.float32:
                raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(shard[key].shape)} "
                                 f"{shard[key].dtype}; expected ({self.layout.shard_numel},) float32")
        if self.stage == 0:
            for key in STATE_KEYS:
                full = getattr(self, key)
                full[self.my_range].copy_(shard[key])
                collectives.all_gather(full, full[self.my_range], self.comm)
        else:
            for key in STATE_KEYS:
                getattr(self, key).copy_(shard[key])
            self.flat_params[self.my_range].copy_(self.master)
            collectives.all_gather(self.flat_params, self.flat_params[self.my_range], self.comm)
        self.step_count = step_count

    def param_norm(self) -> float:
        return float(self.flat_params.pow(2).sum().sqrt())

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by the tensors that exist on this rank (measured, not from the formula)."""
        optimizer = {id(t): t for t in (self.exp_avg, self.exp_avg_sq)}
        if self.master is not self.flat_params:
            optimizer[id(self.master)] = self.master
        return {"params": _nbytes(self.flat_params), "grads": _nbytes(self.flat_grads),
                "optimizer": sum(_nbytes(t) for t in optimizer.values())}

    def expected_bytes(self) -> dict[str, float]:
        """The memory formula for this stage, P parameters over N ranks, fp32 + Adam."""
        p, n = self.layout.numel, self.comm.size
        if self.stage == 0:
            return {"params": 4 * p, "grads": 4 * p, "optimizer": 8 * p}
        return {"params": 4 * p, "grads": 4 * p, "optimizer": 12 * p / n}

    def padding_allowance_bytes(self) -> dict[str, float]:
        """How far measured bytes may exceed the formula: the padded tail (< N elements)."""
        pad, n = self.layout.padded_numel - self.layout.numel, self.comm.size
        return {"params": 4 * pad, "grads": 4 * pad, "optimizer": 8 * pad if self.stage == 0 else 12 * pad / n}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
