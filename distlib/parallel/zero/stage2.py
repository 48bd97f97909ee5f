"""ZeRO stage 2: gradients are reduce-scattered in buckets during backward.

The parameters are grouped into buckets of consecutive flat ranges, whole
modules at a time (a module's weight and bias arrive together), packed in
backward order up to ``bucket_numel`` elements. A post-accumulate-grad hook on
every parameter copies its fresh gradient into its bucket's fp32 buffer
(allocated on the first arrival) and drops the parameter's ``.grad``; when the
bucket's last gradient lands, the bucket is reduce-scattered straight into the
ranks' partitions (uneven bounds: each rank receives exactly the part of the
bucket that falls in its partition), added to the fp32 gradient partition, and
freed. Full gradients never persist: what lives is the 4P/N partition, the
bucket being filled, and one parameter's gradient for the duration of a hook.

With gradient accumulation each micro-batch's backward reduce-scatters again and
accumulates into the partition, so gradient memory stays 4P/N (at the price of
K reduce-scatters per step, which stages 0/1 avoid by syncing once).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from distlib.comm import collectives
from distlib.parallel.adamw import AdamWConfig
from distlib.comm.group import Comm
from distlib.parallel.tensor_parallel import TPGroup
from distlib.parallel.zero.stage01 import ZeroOptimizer


@dataclass(frozen=True)
class Bucket:
    lo: int                     # flat range [lo, hi) of its parameters
    hi: int
    params: tuple[int, ...]     # indices into layout.slots

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def module_groups(module: nn.Module) -> list[tuple[int, ...]]:
    """Parameter indices (flat order) grouped by the module that owns them directly."""
    index = {id(p): i for i, p in enumerate(module.parameters())}
    groups = []
    for sub in module.modules():
        own = tuple(index[id(p)] for p in sub.parameters(recurse=False))
        if own:
            groups.append(own)
    return sorted(groups)


def contiguous_bucket(groups: list[tuple[int, ...]], slots) -> Bucket:
    params = tuple(sorted(i for g in groups for i in g))
    if params != tuple(range(params[0], params[-1] + 1)):
        raise ValueError(f"bucket parameters {params} are not contiguous in the flat layout")
    last = slots[params[-1]]
    return Bucket(slots[params[0]].offset, last.offset + last.numel, params)


class Zero2Optimizer(ZeroOptimizer):
    STAGES = (2,)

    def __init__(self, module: nn.Module, comm: Comm, cfg: AdamWConfig, grad_clip: float = 0.0, *,
                 tp: TPGroup | None = None, param_dtype: torch.dtype = torch.float32, bucket_numel: int = 8192):
        if bucket_numel < 1:
            raise ValueError(f"zero.bucket_numel must be >= 1, got {bucket_numel}")
        self.bucket_numel = bucket_numel
        super().__init__(module, comm, self.STAGES[0], cfg, grad_clip, tp=tp, param_dtype=param_dtype)

    # -- storage ------------------------------------------------------------------
    def _init_storage(self, fp32_flat: torch.Tensor) -> None:
        self.flat_params = fp32_flat.to(self.param_dtype) if self.param_dtype != torch.float32 else fp32_flat
        self._view_params(self.flat_params)
        self._init_partition_state(fp32_flat)
        self._init_buckets()

    def _init_buckets(self) -> None:
        self.grad_partition = torch.zeros(self.layout.shard_numel)
        self.buckets = self._plan_buckets()
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.params}
        self._bucket_buffers: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._arrived: list[set[int]] = [set() for _ in self.buckets]   # params whose gradient is in
        self._reductions = [0] * len(self.buckets)   # per bucket, this step (= micro-batches)
        for i, p in enumerate(self.params):
            p.grad = None
            p.register_post_accumulate_grad_hook(self._grad_ready_hook(i))

    def _plan_buckets(self) -> list[Bucket]:
        """Whole modules, in backward (reverse flat) order, packed up to bucket_numel elements."""
        buckets, current, size = [], [], 0
        for group in reversed(module_groups(self.module)):
            numel = sum(self.layout.slots[i].numel for i in group)
            if current and size + numel > self.bucket_numel:
                buckets.append(contiguous_bucket(current, self.layout.slots))
                current, size = [], 0
            current.append(group)
            size += numel
        if current:
            buckets.append(contiguous_bucket(current, self.layout.slots))
        return buckets

    def _live_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [self.flat_params],
                "grads": [self.grad_partition] + [t for t in self._bucket_buffers if t is not None]
                         + [p.grad for p in self.params if p.grad is not None],
                "optimizer": [self.master, self.exp_avg, self.exp_avg_sq]}

    # -- backward hooks -----------------------------------------------------------
    def _grad_ready_hook(self, index: int):
        slot = self.layout.slots[index]

        @torch.no_grad()
        def hook(p: torch.Tensor) -> None:
            b = self._bucket_of[index]
            bucket = self.buckets[b]
            if self._bucket_buffers[b] is None:
                self._bucket_buffers[b] = torch.empty(bucket.numel)
            start = slot.offset - bucket.lo
            self._bucket_buffers[b][start:start + slot.numel].copy_(p.grad.reshape(-1))
            self._arrived[b].add(index)
            self._sample_memory()
            p.grad = None
            if len(self._arrived[b]) == len(bucket.params):
                self._reduce_bucket(b)
        return hook

    def _reduce_bucket(self, b: int) -> None:
        bucket, buffer = self.buckets[b], self._bucket_buffers[b]
        bounds = self.layout.bounds_within(bucket.lo, bucket.hi)
        self._count(buffer)
        mine = collectives.reduce_scatter(buffer, self.comm, op="avg", bounds=bounds)
        a, z = bounds[self.comm.rank]
        if z > a:
            start = bucket.lo + a - self.my_range.start
            self.grad_partition[start:start + (z - a)].add_(mine)
        self._bucket_buffers[b] = None
        self._arrived[b] = set()
        self._reductions[b] += 1
        self._bucket_reduced(b)

    def _bucket_reduced(self, b: int) -> None:
        """Hook for stage 3 (free the block's gathered parameters)."""

    # -- the step -----------------------------------------------------------------
    @property
    def grad_buffer(self) -> torch.Tensor:
        return self.grad_partition

    def _zero_grads(self) -> None:
        self.grad_partition.zero_()

    def _reduce_grads(self) -> torch.Tensor:
        """The gradients were reduced during backward; check that every bucket was reduced the same
        number of times (a parameter without a gradient would leave its bucket waiting forever)."""
        most = max(self._reductions)
        missing = [i for b, bucket in enumerate(self.buckets) for i in bucket.params
                   if self._reductions[b] < most or (self._arrived[b] and i not in self._arrived[b])]
        if missing:
            names = [self.layout.slots[i].name for i in sorted(missing)]
            raise RuntimeError(f"ZeRO-{self.stage}: incomplete gradient buckets (reductions per bucket "
                               f"{self._reductions}): {len(names)} parameter(s) did not receive a gradient in "
                               f"every backward since the last step, e.g. {names[:4]}")
        self._reductions = [0] * len(self.buckets)
        self._sample_memory()
        return self.grad_partition

    def memory_formula(self) -> dict[str, tuple[float, float, str]]:
        """Stage 2: params bP, grads 4P/N (+ one bucket + one parameter's gradient), Adam 12P/N."""
        p, n, b = self.layout.numel, self.comm.size, self._bytes_per_param()
        pad = self.layout.padded_numel - p
        largest_param = max(s.numel for s in self.layout.slots)
        bucket = 4 * max(k.numel for k in self.buckets)
        return {"params": (b * p, b * pad, f"{b}P"),
                "grads": (4 * p / n, 4 * pad / n + bucket + b * largest_param, "4P/N + bucket"),
                "optimizer": (12 * p / n, 12 * pad / n, "12P/N")}
