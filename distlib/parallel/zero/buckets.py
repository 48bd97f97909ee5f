"""The gradients of stages 2 and 3: buckets reduce-scattered from backward hooks.

A bucket is a contiguous flat range of whole modules' parameters (a module's weight and bias
arrive together). A post-accumulate-grad hook on every parameter copies its fresh gradient into
its bucket's fp32 buffer (allocated on the first arrival) and drops the parameter's ``.grad``;
when the bucket's last gradient lands, the bucket is reduce-scattered straight into the ranks'
partitions (uneven bounds: each rank receives exactly the part of the bucket inside its
partition), added to the fp32 gradient partition, and freed. Full gradients never persist: what
lives is the 4P/N partition, the bucket being filled, and one parameter's gradient for the
duration of a hook. With K micro-batches each backward reduces again and accumulates into the
partition (K reduce-scatters per step, which stages 0/1 avoid by syncing once).

With a ``progress`` (``overlap``), the hook hands the bucket's reduce-scatter to the
communication thread instead of running it, and ``collect`` waits for all of them first. At most
MAX_QUEUED buckets are queued or running (a hook that would queue one more first waits for the
oldest), so backward cannot outrun the thread by more than that: the gradient memory stays
4P/N + (MAX_QUEUED + 1) buckets instead of growing to the whole gradient.

Stage 2 packs modules into buckets by size (``buckets_by_size``); stage 3 uses one bucket per
unit (its gathered block), and is told when a bucket is reduced so it can free the unit.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from distlib.comm import collectives
from distlib.comm.group import Comm
from distlib.comm.progress import Progress
from distlib.parallel.flat_layout import FlatLayout, ParamSlot

# Elements per gradient bucket (32 KiB of fp32; zero.bucket_numel's default): the capstone's
# blocks fit a few buckets each, so a bucket's reduce-scatter can start while backward goes on.
BUCKET_NUMEL = 8192

MAX_QUEUED = 1  # (overlap) buckets whose reduce-scatter may be queued or running at once: one
# runs while backward fills the next; more would only let backward run further ahead of a busy thread


@dataclass(frozen=True)
class Bucket:
    lo: int  # flat range [lo, hi) of its parameters
    hi: int
    params: tuple[int, ...]  # indices into layout.slots

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def module_groups(module: nn.Module, params: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """Indices into ``params`` (the optimizer's, in flat order) grouped by the module that owns them
    directly. A parameter two modules hold (a tied embedding and LM head) belongs to the first of
    them: every parameter is in exactly one group, so its one gradient fills exactly one bucket."""
    index = {id(p): i for i, p in enumerate(params)}
    groups, seen = [], set()
    for sub in module.modules():
        mine = [p for p in sub.parameters(recurse=False) if id(p) in index]
        own = tuple(index[id(p)] for p in mine if id(p) not in seen)
        seen.update(id(p) for p in mine)
        if own:
            groups.append(own)
    return sorted(groups)


def contiguous_bucket(groups: list[tuple[int, ...]], slots: Sequence[ParamSlot]) -> Bucket:
    params = tuple(sorted(i for g in groups for i in g))
    if params != tuple(range(params[0], params[-1] + 1)):
        raise ValueError(f"bucket parameters {params} are not contiguous in the flat layout")
    last = slots[params[-1]]
    return Bucket(slots[params[0]].offset, last.offset + last.numel, params)


def buckets_by_size(
    module: nn.Module,
    params: Sequence[torch.Tensor],
    layout: FlatLayout,
    bucket_numel: int,
    segments: Sequence[Collection[str]] = (),
) -> list[Bucket]:
    """``params`` (laid out by ``layout``) by whole modules, in backward (reverse flat) order,
    packed up to ``bucket_numel`` elements; no bucket holds parameters of two ``segments`` (names:
    the pipeline chunks of an interleaved stage, whose backwards run apart, one micro-batch at a
    time: a bucket across two would see one chunk's gradients twice before the other's once)."""
    if bucket_numel < 1:
        raise ValueError(f"zero.bucket_numel must be >= 1, got {bucket_numel}")
    segment_of = {name: k for k, names in enumerate(segments) for name in names}
    buckets, current, size, segment = [], [], 0, None
    for group in reversed(module_groups(module, params)):
        numel = sum(layout.slots[i].numel for i in group)
        mine = segment_of.get(layout.slots[group[0]].name)
        if current and (size + numel > bucket_numel or mine != segment):
            buckets.append(contiguous_bucket(current, layout.slots))
            current, size = [], 0
        current.append(group)
        size += numel
        segment = mine
    if current:
        buckets.append(contiguous_bucket(current, layout.slots))
    return buckets


class GradBuckets:
    """This rank's fp32 gradient partition, filled bucket by bucket during backward.

    ``sample`` runs in every hook (while the parameter's gradient and the bucket are alive);
    ``reduced(b)`` runs after bucket ``b``'s reduce-scatter was run (or, with ``progress``, queued)."""

    def __init__(
        self,
        layout: FlatLayout,
        params: Sequence[torch.Tensor],
        comm: Comm,
        buckets: list[Bucket],
        sample: Callable[[], None],
        reduced: Callable[[int], None] = lambda b: None,
        progress: Progress | None = None,
    ):
        self.layout, self.params, self.comm, self.buckets = layout, list(params), comm, buckets
        self._sample, self._reduced = sample, reduced
        self.my_start = layout.shard_range(comm.rank)[0]
        self.partition = torch.zeros(layout.shard_numel, device=self.params[0].device)
        self._bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket.params}
        self._buffers: list[torch.Tensor | None] = [None] * len(buckets)
        self._arrived: list[set[int]] = [set() for _ in buckets]  # params whose gradient is in
        self._reductions = [0] * len(buckets)  # per bucket, this step (= micro-batches)
        self.progress = progress
        self._sending: dict[int, torch.Tensor] = {}  # (overlap) id -> bucket whose reduce-scatter is queued
        self._queued: collections.deque = collections.deque()  # (overlap) their tickets, oldest first
        for i, p in enumerate(self.params):
            p.grad = None
            p.register_post_accumulate_grad_hook(self._grad_ready_hook(i))

    def live(self) -> list[torch.Tensor]:
        """The gradient tensors alive now: the partition, the buckets being filled and those queued."""
        return [self.partition] + [t for t in self._buffers if t is not None] + list(self._sending.values())

    @property
    def largest(self) -> int:
        return max(k.numel for k in self.buckets)

    def _grad_ready_hook(self, index: int):
        slot = self.layout.slots[index]

        @torch.no_grad()
        def hook(p: torch.Tensor) -> None:
            b = self._bucket_of[index]
            bucket = self.buckets[b]
            if self._buffers[b] is None:
                self._buffers[b] = torch.empty(bucket.numel, device=self.partition.device)
            start = slot.offset - bucket.lo
            self._buffers[b][start : start + slot.numel].copy_(p.grad.reshape(-1))
            self._arrived[b].add(index)
            self._sample()
            p.grad = None
            if len(self._arrived[b]) == len(bucket.params):
                self._reduce(b)

        return hook

    def _reduce(self, b: int) -> None:
        buffer = self._buffers[b]
        self._buffers[b] = None
        self._arrived[b] = set()
        self._reductions[b] += 1
        if self.progress is None:
            self._reduce_into_partition(b, buffer)
        else:
            while len(self._queued) >= MAX_QUEUED:
                self._queued.popleft().wait()
            self._sending[id(buffer)] = buffer
            self._queued.append(self.progress.submit(self._reduce_into_partition, b, buffer))
        self._reduced(b)

    @torch.no_grad()
    def _reduce_into_partition(self, b: int, buffer: torch.Tensor) -> None:
        bucket = self.buckets[b]
        bounds = self.layout.bounds_within(bucket.lo, bucket.hi)
        mine = collectives.reduce_scatter(buffer, self.comm, op="avg", bounds=bounds)
        a, z = bounds[self.comm.rank]
        if z > a:
            start = bucket.lo + a - self.my_start
            self.partition[start : start + (z - a)].add_(mine)
        self._sending.pop(id(buffer), None)

    def collect(self, stage: int) -> torch.Tensor:
        """The reduced partition, after checking that every bucket was reduced the same number of
        times (a parameter without a gradient would leave its bucket waiting forever)."""
        if self.progress is not None:
            self.progress.drain()
            self._queued.clear()
        most = max(self._reductions)
        missing = [
            i
            for b, bucket in enumerate(self.buckets)
            for i in bucket.params
            if self._reductions[b] < most or (self._arrived[b] and i not in self._arrived[b])
        ]
        if missing:
            names = [self.layout.slots[i].name for i in sorted(missing)]
            raise RuntimeError(
                f"ZeRO-{stage}: incomplete gradient buckets (reductions per bucket "
                f"{self._reductions}): {len(names)} parameter(s) did not receive a gradient in "
                f"every backward since the last step, e.g. {names[:4]}"
            )
        self._reductions = [0] * len(self.buckets)
        return self.partition
