"""ZeRO stage 3: parameters are sharded too, and gathered one block at a time.

A *unit* is a top-level child of the model (the embeddings, each transformer
block, the final LayerNorm, the LM head; a ModuleList counts as its children);
its parameters are one contiguous flat range. Each rank keeps only its partition
of the parameters (``param_shard``, in the compute dtype). A unit's parameters
are views into a unit-sized buffer whose storage is empty except while needed:

  forward pre-hook    all-gather the unit (uneven bounds: each rank contributes the
                      part of the unit inside its partition), then run it;
  forward hook        free the storage, and hook the unit's output so that
  output grad hook    the unit is gathered again just before its backward runs;
  last grad of unit   (stage 2's bucket hook, one bucket per unit) reduce-scatter
                      the unit's gradients into the partitions and free the storage.

Autograd saved the parameters' *views*, so refilling the same storage before
backward is all it needs. PyTorch runs a parameter's gradient accumulation as
soon as it is produced, so a unit's gradients are complete, and its storage
freed, before the next unit's backward gathers: one unit is live at a time.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from distlib.comm import collectives
from distlib.parallel.adamw import AdamWConfig
from distlib.comm.group import Comm
from distlib.parallel.tensor_parallel import TPGroup
from distlib.parallel.zero.stage2 import Bucket, Zero2Optimizer, contiguous_bucket


def unit_modules(model: nn.Module) -> list[nn.Module]:
    """The model's top-level children that hold parameters (ModuleLists expanded)."""
    if any(True for _ in model.parameters(recurse=False)):
        raise ValueError(f"ZeRO-3 needs every parameter inside a child module; {type(model).__name__} "
                         f"holds some directly")
    units = []
    for child in model.children():
        for m in (child if isinstance(child, (nn.ModuleList, nn.Sequential)) else [child]):
            if any(True for _ in m.parameters()):
                units.append(m)
    return units


class Zero3Optimizer(Zero2Optimizer):
    STAGES = (3,)

    def __init__(self, module: nn.Module, comm: Comm, cfg: AdamWConfig, grad_clip: float = 0.0, *,
                 tp: TPGroup | None = None, param_dtype: torch.dtype = torch.float32):
        super().__init__(module, comm, cfg, grad_clip, tp=tp, param_dtype=param_dtype)

    def _init_storage(self, fp32_flat: torch.Tensor) -> None:
        self.param_shard = fp32_flat[self.my_range].to(self.param_dtype, copy=True)
        self._init_partition_state(fp32_flat)
        self._init_buckets()                       # one bucket per unit, see _plan_buckets
        self._gathered = [False] * len(self.buckets)
        self._unit_buffers = []
        for b, (bucket, unit) in enumerate(zip(self.buckets, self._units)):
            full = torch.empty(bucket.numel, dtype=self.param_dtype)
            for i in bucket.params:
                slot = self.layout.slots[i]
                start = slot.offset - bucket.lo
                self.params[i].data = full[start:start + slot.numel].view(slot.shape)
            full.untyped_storage().resize_(0)
            self._unit_buffers.append(full)
            unit.register_forward_pre_hook(lambda m, args, b=b: self._gather(b))
            unit.register_forward_hook(lambda m, args, out, b=b: self._after_forward(b, out))

    def _plan_buckets(self) -> list[Bucket]:
        """One bucket per unit: its gradients are reduced, and its storage freed, together."""
        self._units = unit_modules(self.module)
        index = {id(p): i for i, p in enumerate(self.params)}
        return [contiguous_bucket([tuple(index[id(p)] for p in u.parameters())], self.layout.slots)
                for u in self._units]

    def _live_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [self.param_shard] + self._unit_buffers,
                "grads": [self.grad_partition] + [t for t in self._bucket_buffers if t is not None]
                         + [p.grad for p in self.params if p.grad is not None],
                "optimizer": [self.master, self.exp_avg, self.exp_avg_sq]}

    # -- gather / free --------------------------------------------------------------
    @torch.no_grad()
    def _gather(self, b: int) -> None:
        if self._gathered[b]:
            return
        bucket, full = self.buckets[b], self._unit_buffers[b]
        full.untyped_storage().resize_(bucket.numel * full.element_size())
        bounds = self.layout.bounds_within(bucket.lo, bucket.hi)
        a, z = bounds[self.comm.rank]
        start = bucket.lo + a - self.my_range.start
        self._count(full)
        collectives.all_gather(full, self.param_shard[start:start + (z - a)], self.comm, bounds=bounds)
        self._gathered[b] = True
        self._sample_memory()

    def _release(self, b: int) -> None:
        self._unit_buffers[b].untyped_storage().resize_(0)
        self._gathered[b] = False

    def _after_forward(self, b: int, out) -> None:
        self._release(b)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._gather(b))

    def _bucket_reduced(self, b: int) -> None:
        self._release(b)

    # -- the step -------------------------------------------------------------------
    def _publish_params(self) -> None:
        self.param_shard.copy_(self.master)

    def param_norm(self) -> float:
        terms = torch.zeros(self.comm.size, 2)
        collectives.all_gather(terms.view(-1), self._square_terms(self.param_shard, self.comm.rank), self.comm)
        return self._norm_from_terms(terms)

    @property
    def param_buffer(self) -> torch.Tensor:
        return self.param_shard

    @property
    def param_buffer_start(self) -> int:
        return self.my_range.start

    @torch.no_grad()
    def full_params(self) -> torch.Tensor:
        """A gathered copy of every partition (a temporary bP, outside the step's memory peak)."""
        full = torch.empty(self.layout.padded_numel, dtype=self.param_dtype)
        collectives.all_gather(full, self.param_shard, self.comm)
        return full

    def memory_formula(self) -> dict[str, tuple[float, float, str]]:
        """Stage 3: params bP/N (+ one gathered unit), grads 4P/N (+ the unit's fp32 gradient
        bucket + one parameter's gradient), Adam 12P/N."""
        p, n, b = self.layout.numel, self.comm.size, self._bytes_per_param()
        pad = self.layout.padded_numel - p
        largest_unit = max(k.numel for k in self.buckets)
        largest_param = max(s.numel for s in self.layout.slots)
        return {"params": (b * p / n, b * pad / n + b * largest_unit, f"{b}P/N + unit"),
                "grads": (4 * p / n, 4 * pad / n + 4 * largest_unit + b * largest_param, "4P/N + unit"),
                "optimizer": (12 * p / n, 12 * pad / n, "12P/N")}
