"""ZeRO: an AdamW step that shards optimizer state across data-parallel ranks.

All parameters are laid out in one flat buffer (``distlib.flat_layout``), padded
to a multiple of the data-parallel size N; rank r owns partition r. ``step()``
replaces ``optimizer.step()``; it is ``sync_grads()`` (which returns the global
grad norm) followed by ``apply_update(lr)``, so a caller can look at the norm and
the loss before deciding to update:

  stage 0  all-reduce the flat grads (SUM / N); every rank runs AdamW on everything.
  stage 1  reduce-scatter the flat grads -> this rank's partition; AdamW on the fp32
           master partition; write it into the params; all-gather the params.
  stage 2  (distlib/zero2.py) gradients are reduce-scattered in buckets from backward
           hooks as they become ready; only the partition persists.
  stage 3  (distlib/zero3.py) parameters are sharded too, gathered per block.

Whatever the stage, a checkpoint holds partition r of the fp32 (master, exp_avg,
exp_avg_sq) on rank r, so the on-disk format does not depend on the stage.

Mixed precision (``param_dtype=torch.bfloat16``): the module computes with bf16
parameters; gradients are accumulated and reduced in fp32 and the master weights
and Adam state stay fp32. Memory is *measured*: ``memory_bytes()`` is the peak,
over the run, of the bytes of the live tensors in each category, sampled where
they peak (in the gradient hooks, around each gather, before and after update).
docs/parallelism.md has the formulas and the buffers they allow for.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from distlib.comm import collectives
from distlib.parallel.adamw import AdamWConfig, adamw_step_
from distlib.comm.group import Comm
from distlib.parallel.flat_layout import FlatLayout, ParamSlot  # noqa: F401 - FlatLayout is part of this API
from distlib.parallel.tensor_parallel import TPGroup

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
CATEGORIES = ("params", "grads", "optimizer")


def make_optimizer(module: nn.Module, comm: Comm, stage: int, cfg: AdamWConfig, grad_clip: float = 0.0, *,
                   tp: TPGroup | None = None, param_dtype: torch.dtype = torch.float32,
                   bucket_numel: int = 8192) -> "ZeroOptimizer":
    """The optimizer for ``stage`` over the data-parallel group ``comm``."""
    from distlib.parallel.zero.stage2 import Zero2Optimizer  # the stage 2/3 modules build on this one
    from distlib.parallel.zero.stage3 import Zero3Optimizer
    if stage in (0, 1):
        return ZeroOptimizer(module, comm, stage, cfg, grad_clip, tp=tp, param_dtype=param_dtype)
    if stage == 2:
        return Zero2Optimizer(module, comm, cfg, grad_clip, tp=tp, param_dtype=param_dtype,
                              bucket_numel=bucket_numel)
    if stage == 3:
        return Zero3Optimizer(module, comm, cfg, grad_clip, tp=tp, param_dtype=param_dtype)
    raise ValueError(f"zero.stage must be one of 0, 1, 2, 3, got {stage}")


class ZeroOptimizer:
    """AdamW over a data-parallel group with ZeRO stage 0 or 1 (and the base of stages 2, 3)."""
    STAGES = (0, 1)

    def __init__(self, module: nn.Module, comm: Comm, stage: int, cfg: AdamWConfig, grad_clip: float = 0.0, *,
                 tp: TPGroup | None = None, param_dtype: torch.dtype = torch.float32):
        if stage not in self.STAGES:
            raise ValueError(f"zero.stage must be one of {self.STAGES} for {type(self).__name__}, got {stage}")
        if grad_clip < 0:
            raise ValueError(f"optimizer.grad_clip must be >= 0 (0 disables), got {grad_clip}")
        if param_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"parameter dtype must be float32 or bfloat16, got {param_dtype}")
        self.module, self.comm, self.stage, self.cfg, self.grad_clip = module, comm, stage, cfg, grad_clip
        self.tp = tp if tp is not None else TPGroup(Comm(ranks=(comm.peer(comm.rank),), rank=0))
        self.param_dtype = param_dtype
        self.params = list(module.parameters())
        self.layout = FlatLayout.of(module, comm.size)
        self.step_count = 0
        self._synced: tuple[torch.Tensor, float] | None = None   # set by sync_grads, used by apply_update
        self.my_range = slice(*self.layout.shard_range(comm.rank))
        self.comm_bytes = 0                              # sent so far in the current step
        self.last_step_comm_bytes = {"dp": 0, "tp": 0}   # sent during the last completed step
        self._tp_bytes_at_step_start = self.tp.bytes_sent
        self._peak = dict.fromkeys(CATEGORIES, 0)
        self._norm_segments = self._plan_norm_segments()
        fp32_flat = torch.zeros(self.layout.padded_numel)
        with torch.no_grad():
            for slot, p in zip(self.layout.slots, self.params):
                fp32_flat[slot.offset:slot.offset + slot.numel].copy_(p.reshape(-1))
        self._init_storage(fp32_flat)
        del fp32_flat
        self._sample_memory()

    # -- storage (per stage) ----------------------------------------------------
    def _init_storage(self, fp32_flat: torch.Tensor) -> None:
        low_precision = self.param_dtype != torch.float32
        self.flat_params = fp32_flat.to(self.param_dtype) if low_precision else fp32_flat
        self.flat_grads = torch.zeros(self.layout.padded_numel)
        self._view_params(self.flat_params)
        for slot, p in zip(self.layout.slots, self.params):
            if low_precision:   # accumulate the bf16 gradients into the fp32 buffer, then drop them
                p.grad = None
                p.register_post_accumulate_grad_hook(self._accumulate_hook(slot))
            else:               # autograd accumulates straight into the flat buffer
                p.grad = self.flat_grads[slot.offset:slot.offset + slot.numel].view(slot.shape)
        if self.stage == 0:
            self.master = fp32_flat.clone() if low_precision else self.flat_params
            self.exp_avg = torch.zeros(self.layout.padded_numel)
            self.exp_avg_sq = torch.zeros(self.layout.padded_numel)
        else:
            self._init_partition_state(fp32_flat)

    def _init_partition_state(self, fp32_flat: torch.Tensor) -> None:
        self.master = fp32_flat[self.my_range].clone()
        self.exp_avg = torch.zeros(self.layout.shard_numel)
        self.exp_avg_sq = torch.zeros(self.layout.shard_numel)

    def _view_params(self, flat: torch.Tensor) -> None:
        for slot, p in zip(self.layout.slots, self.params):
            p.data = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def _accumulate_hook(self, slot: ParamSlot):
        def hook(p: torch.Tensor) -> None:
            self.flat_grads[slot.offset:slot.offset + slot.numel].add_(p.grad.reshape(-1))
            self._sample_memory()
            p.grad = None
        return hook

    def _live_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds right now, by category (views share their storage)."""
        return {"params": [self.flat_params],
                "grads": [self.flat_grads] + [p.grad for p in self.params if p.grad is not None],
                "optimizer": [self.master, self.exp_avg, self.exp_avg_sq]}

    def _publish_params(self) -> None:
        """Make the module's parameters reflect the updated master weights."""
        if self.stage == 0:
            if self.master is not self.flat_params:
                self.flat_params.copy_(self.master)
            return
        self.flat_params[self.my_range].copy_(self.master)
        self._count(self.flat_params)
        collectives.all_gather(self.flat_params, self.flat_params[self.my_range], self.comm)

    # -- the step -------------------------------------------------------------
    def _zero_grads(self) -> None:
        self.flat_grads.zero_()

    @torch.no_grad()
    def _reduce_grads(self) -> torch.Tensor:
        """Average this step's gradients over the data-parallel group: all of them for stage 0,
        this rank's partition otherwise."""
        self._sample_memory()
        self._count(self.flat_grads, all_reduce=self.stage == 0)
        if self.stage == 0:
            return collectives.all_reduce(self.flat_grads, self.comm, op="avg")
        return collectives.reduce_scatter(self.flat_grads, self.comm, op="avg")

    @torch.no_grad()
    def sync_grads(self) -> float:
        """First half of ``step``: average the gradients over the data-parallel ranks (this rank keeps
        what it updates) and return the global grad norm (before clipping), identical on every rank.
        Nothing is updated yet, so a caller can still decide not to ``apply_update``."""
        grads = self._reduce_grads()
        self._synced = (grads, self._global_norm(grads[self.my_range] if self.stage == 0 else grads))
        return self._synced[1]

    def synced_grad_partition(self) -> torch.Tensor:
        """This rank's partition of the averaged gradient ``sync_grads`` produced (tests inspect it)."""
        if self._synced is None:
            raise RuntimeError("synced_grad_partition() needs sync_grads() first")
        grads = self._synced[0]
        return grads[self.my_range] if self.stage == 0 else grads

    @torch.no_grad()
    def apply_update(self, lr: float | None = None) -> None:
        """Second half of ``step``: clip by the global norm, AdamW on the master, publish the params."""
        if self._synced is None:
            raise RuntimeError(f"{type(self).__name__}.apply_update() needs sync_grads() first (once per update)")
        (grads, grad_norm), self._synced = self._synced, None
        if self.grad_clip > 0:
            coef = min(self.grad_clip / (grad_norm + 1e-6), 1.0)  # torch.nn.utils.clip_grad_norm_'s
            if coef < 1.0:
                grads.mul_(coef)
        self.step_count += 1
        adamw_step_(self.master, grads, self.exp_avg, self.exp_avg_sq, self.step_count, self.cfg, lr)
        self._publish_params()
        self._sample_memory()

    def step(self, lr: float | None = None) -> float:
        """Replaces ``optimizer.step()``. Returns the global grad norm (before clipping)."""
        grad_norm = self.sync_grads()
        self.apply_update(lr)
        return grad_norm

    def zero_grad(self) -> None:
        """Clear the gradients (and drop synchronised ones that were never applied); this ends the
        step for the traffic count."""
        self._zero_grads()
        self._synced = None
        self.last_step_comm_bytes = {"dp": self.comm_bytes, "tp": self.tp.bytes_sent - self._tp_bytes_at_step_start}
        self.comm_bytes, self._tp_bytes_at_step_start = 0, self.tp.bytes_sent

    def _count(self, t: torch.Tensor, all_reduce: bool = False) -> None:
        """Nominal bytes this rank sends: (N-1)/N * B per reduce-scatter or all-gather of B bytes,
        twice that per all-reduce (what the ring algorithms send)."""
        n = self.comm.size
        self.comm_bytes += (2 if all_reduce else 1) * (n - 1) * t.numel() * t.element_size() // n

    # -- norms: each TP-split parameter counted on its rank, replicated ones once --
    def _plan_norm_segments(self) -> list[list[tuple[int, int, bool]]]:
        """Per partition: (start, end, tp_split) runs of parameters, relative to the partition."""
        split = set(self.tp.splits)
        out = []
        for rank in range(self.comm.size):
            lo, hi = self.layout.shard_range(rank)
            runs = []
            for s in self.layout.slots:
                a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < b:
                    runs.append((a - lo, b - lo, s.name in split))
            out.append(runs)
        return out

    def _square_terms(self, part: torch.Tensor, rank: int) -> torch.Tensor:
        """[sum of squares over TP-split params, over replicated params] of partition ``rank``."""
        terms = torch.zeros(2)
        for a, b, is_split in self._norm_segments[rank]:
            terms[0 if is_split else 1] += part[a:b].float().pow(2).sum()
        return terms

    def _norm_from_terms(self, terms: torch.Tensor) -> float:
        """terms: (N, 2) per partition, in rank order. Split params are summed over the TP group;
        replicated ones are identical on every TP rank and counted once."""
        split_sq, replicated_sq = terms.sum(dim=0)
        if self.tp.comm.size > 1:
            per_tp = torch.zeros(self.tp.comm.size)
            collectives.all_gather(per_tp, split_sq.reshape(1), self.tp.comm)
            split_sq = per_tp.sum()
        return float((split_sq + replicated_sq).sqrt())

    def _global_norm(self, partition: torch.Tensor) -> float:
        terms = torch.zeros(self.comm.size, 2)
        collectives.all_gather(terms.view(-1), self._square_terms(partition, self.comm.rank), self.comm)
        return self._norm_from_terms(terms)

    def param_norm(self) -> float:
        """Norm of the whole (unsharded) model's parameters, from this rank's copy of them."""
        return self._norm_from_terms(torch.stack([
            self._square_terms(self.flat_params[slice(*self.layout.shard_range(r))], r)
            for r in range(self.comm.size)]))

    @property
    def param_buffer(self) -> torch.Tensor:
        """The parameter values this rank holds, flat: all of them at stages 0-2, its partition at 3
        (with tensor parallelism, of its tensor-parallel shard of the model)."""
        return self.flat_params

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The fp32 buffer gradients accumulate into before ``sync_grads``: all of them at stages
        0/1, this rank's (already reduced) partition at stages 2/3."""
        return self.flat_grads

    @property
    def param_buffer_start(self) -> int:
        """Flat offset of ``param_buffer``'s first element (0, or the partition's start at stage 3)."""
        return 0

    def full_params(self) -> torch.Tensor:
        """Every parameter of this rank's model (its tensor-parallel shard), flat in layout order:
        the live buffer at stages 0-2; at stage 3 a gathered copy (collective over the group)."""
        return self.flat_params

    def params_snapshot(self) -> torch.Tensor:
        """A copy of the parameter bytes this rank holds (for byte-exact restore checks)."""
        return self.param_buffer.clone()

    # -- state for checkpoints ----------------------------------------------------
    def _mine(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.my_range] if self.stage == 0 else t

    def state_shard(self) -> dict[str, torch.Tensor]:
        """This rank's partition of (master, exp_avg, exp_avg_sq), as fp32 copies."""
        return {k: self._mine(getattr(self, k)).clone() for k in STATE_KEYS}

    @torch.no_grad()
    def load_state_shard(self, shard: dict[str, torch.Tensor], step_count: int) -> None:
        for key in STATE_KEYS:
            if shard[key].shape != (self.layout.shard_numel,) or shard[key].dtype != torch.float32:
                raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(shard[key].shape)} "
                                 f"{shard[key].dtype}; expected ({self.layout.shard_numel},) float32")
        for key in STATE_KEYS:
            mine = self._mine(getattr(self, key))
            mine.copy_(shard[key])
            if self.stage == 0:
                collectives.all_gather(getattr(self, key), mine, self.comm)
        self._publish_params()
        self.comm_bytes = 0
        self.step_count = step_count

    # -- memory -----------------------------------------------------------------
    def _sample_memory(self) -> None:
        seen: set[int] = set()
        for category, tensors in self._live_tensors().items():
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen or storage.nbytes() == 0:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            self._peak[category] = max(self._peak[category], total)

    def memory_bytes(self) -> dict[str, int]:
        """Peak bytes, per category, of the tensors alive on this rank (measured, not the formula)."""
        return dict(self._peak)

    def _bytes_per_param(self) -> int:
        return torch.empty(0, dtype=self.param_dtype).element_size()

    def memory_formula(self) -> dict[str, tuple[float, float, str]]:
        """category -> (formula bytes, allowed extra bytes, formula text). P parameters, N ranks,
        b bytes per parameter (4 fp32, 2 bf16); the allowance is the padded tail (< N elements) and,
        in bf16, one parameter's bf16 gradient before the hook folds it into the fp32 buffer."""
        p, n, b = self.layout.numel, self.comm.size, self._bytes_per_param()
        pad = self.layout.padded_numel - p
        transient = b * max(s.numel for s in self.layout.slots) if b != 4 else 0
        if self.stage == 0:
            opt = 8 if b == 4 else 12     # fp32 params are their own master; bf16 ones need one
            return {"params": (b * p, b * pad, f"{b}P"), "grads": (4 * p, 4 * pad + transient, "4P"),
                    "optimizer": (opt * p, opt * pad, f"{opt}P")}
        return {"params": (b * p, b * pad, f"{b}P"), "grads": (4 * p, 4 * pad + transient, "4P"),
                "optimizer": (12 * p / n, 12 * pad / n, "12P/N")}

