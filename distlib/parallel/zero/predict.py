"""The bytes a ZeRO stage's tensors peak at on one rank, predicted before anything is allocated.

``PeakMemory`` (``memory``) measures the peak, per category, of the live tensors' storage at the
points where each stage samples it; ``peak_bytes`` says what that measurement will be, from the
parameter group's flat layout over its N ranks, its module (the buckets and ZeRO-3 units are cut
from it, by the functions the stages cut them with), the compute dtype and the stage's options.
It runs on a model built on the meta device: only shapes are read.

What each stage holds (P padded to a multiple of N, S = P/N the partition, b bytes per compute
element):

    stage  params               grads                                       optimizer
    0      bP                   4P (+ bP_i in a bf16 hook)                   8P fp32 / 12P bf16
    1      bP                   4P (+ bP_i in a bf16 hook)                   12S
    2      bP                   4S + max_i (4 open(i) + b P_i)               12S
    3      bS + gathered units  4S + max_i (4 open(i) + b P_i)               12S

where the max runs over the gradient hooks, P_i is parameter i's size (its gradient is alive in
its hook) and open(i) the elements of the buckets (ZeRO-3: one per unit) begun and not complete
when i's gradient arrives. Gradients arrive in backward order (``arrival_order``); buckets are
cut in reverse module order, so mostly one is open, but a module running its children in
another order opens the next before the last completes. ZeRO-3 keeps one unit gathered at a
time, beside a unit shared by later modules (tied weights) from its first forward to its
gradient. With ``overlap`` a communication thread may still hold the previous bucket, and
ZeRO-3 prefetches the next unit: whether it still does when the rank samples depends on thread
timing, so the prediction is then the most it can be (``exact`` False).
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from distlib.parallel.flat_layout import FlatLayout
from distlib.parallel.zero.buckets import MAX_QUEUED, Bucket, buckets_by_size, contiguous_bucket
from distlib.parallel.zero.units import unit_members


@dataclass(frozen=True)
class Peaks:
    params: int
    grads: int
    optimizer: int
    exact: bool  # False: an upper bound (a communication thread's timing decides the measurement)


def peak_bytes(
    stage: int,
    module: nn.Module,
    layout: FlatLayout,
    param_dtype: torch.dtype,
    bucket_numel: int,
    overlap: bool,
    segments: Sequence[Collection[str]] = (),
) -> Peaks:
    """What ``PeakMemory`` measures for the ZeRO ``stage`` optimizer of ``layout``'s parameters of
    ``module`` (the stage's constructor arguments of the same names)."""
    b = param_dtype.itemsize
    padded, shard = layout.padded_numel, layout.shard_numel
    if stage in (0, 1):
        hook = b * max(s.numel for s in layout.slots) if b != 4 else 0  # bf16 gradient being folded in
        optimizer = (8 if b == 4 else 12) * padded if stage == 0 else 12 * shard
        return Peaks(b * padded, 4 * padded + hook, optimizer, exact=True)
    params = _params_of(module, layout)
    if stage == 2:
        buckets = buckets_by_size(module, params, layout, bucket_numel, segments)
        grads = 4 * shard + _hook_peak(buckets, layout, b, overlap, arrival_order(module, layout))
        return Peaks(b * padded, grads, 12 * shard, exact=not overlap)
    units, shared = _units(module, params, layout)
    return Peaks(
        b * shard + b * _gathered_peak(units, shared, overlap),
        4 * shard + _hook_peak(units, layout, b, overlap, arrival_order(module, layout)),
        12 * shard,
        exact=not overlap,
    )


def _params_of(module: nn.Module, layout: FlatLayout) -> list[torch.Tensor]:
    named = dict(module.named_parameters())
    return [named[s.name] for s in layout.slots]


def arrival_order(module: nn.Module, layout: FlatLayout) -> list[int]:
    """The order (indices into ``layout.slots``) in which backward hands over the gradients: the
    reverse of the order the forward uses the parameters in (autograd runs the nodes made last
    first), which is the modules' order except where a module says its children run in another
    (``PARAMETER_USE``: Mixtral's expert runs w1, w3, then w2). A parameter several modules use
    (tied weights) is placed at its first use: its gradient is complete only after the last
    backward, which reaches its first use last."""
    index = {s.name: i for i, s in enumerate(layout.slots)}
    used: dict[int, None] = {}  # (an ordered set)

    def visit(m: nn.Module, prefix: str) -> None:
        for name, _ in m.named_parameters(prefix=prefix, recurse=False):
            if name in index:
                used.setdefault(index[name], None)
        children = dict(m.named_children())
        first = list(getattr(m, "PARAMETER_USE", ()))
        for child in first + [c for c in children if c not in first]:
            visit(children[child], f"{prefix}.{child}" if prefix else child)

    visit(module, "")
    return list(reversed(used))


def _hook_peak(buckets: Sequence[Bucket], layout: FlatLayout, b: int, overlap: bool, order: list[int]) -> int:
    """The most gradient bytes besides the partition at one hook, with gradients arriving in
    ``order``: the fp32 buckets opened and not yet complete, (overlap) the last MAX_QUEUED handed
    to the communication thread, and the parameter's own gradient in the compute dtype."""
    bucket_of = {i: k for k, bucket in enumerate(buckets) for i in bucket.params}
    waiting = {k: len(bucket.params) for k, bucket in enumerate(buckets)}
    opened: set[int] = set()
    sent: collections.deque = collections.deque(maxlen=MAX_QUEUED if overlap else 0)
    most = 0
    for i in order:
        k = bucket_of[i]
        opened.add(k)
        live = sum(buckets[j].numel for j in opened | set(sent))
        most = max(most, 4 * live + b * layout.slots[i].numel)
        waiting[k] -= 1
        if waiting[k] == 0:
            opened.discard(k)
            sent.append(k)
    return most


def _units(
    module: nn.Module, params: list[torch.Tensor], layout: FlatLayout
) -> tuple[list[Bucket], set[int]]:
    """ZeRO-3's units of ``params`` (as ``Stage3Optimizer`` cuts them) and the indices of those
    shared by later modules (gathered beside the others)."""
    index = {id(p): i for i, p in enumerate(params)}
    members = unit_members(module, params)
    owners = [m for m, owner in members if owner is None]
    units = [
        contiguous_bucket([tuple(index[id(p)] for p in u.parameters() if id(p) in index)], layout.slots)
        for u in owners
    ]
    return units, {owner for _, owner in members if owner is not None}


def _gathered_peak(units: Sequence[Bucket], shared: set[int], overlap: bool) -> int:
    """The most parameter elements gathered at once: a unit (with prefetch, it and the next),
    beside the shared units, held from their first forward to their gradient."""
    held = sum(units[k].numel for k in shared)
    sizes = [0 if k in shared else u.numel for k, u in enumerate(units)]
    if overlap:
        sizes = [a + z for a, z in zip(sizes, sizes[1:] + [0])]
    return held + max(sizes)


def sync_parts(
    stage: int,
    module: nn.Module,
    layout: FlatLayout,
    param_dtype: torch.dtype,
    bucket_numel: int,
    overlap: bool,
    segments: Sequence[Collection[str]] = (),
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The collectives a ZeRO ``stage`` optimizer runs on its group, as (kind, bytes of the whole
    tensor), for the planner's step time, in two lists: those of every micro-batch, and those of the
    step once. The fp32 gradients are reduced (stage 0 all-reduce, else reduce-scatter) once a step
    at stages 0/1 (by bucket with overlap), by bucket after every micro-batch at stage 2 (the
    gradients live in partitions), by unit after every micro-batch at stage 3; the parameters in
    the compute dtype gathered once a step (stages 1/2) or per unit in every micro-batch's forward
    and again in its backward (stage 3)."""
    b = param_dtype.itemsize
    params = _params_of(module, layout)
    if stage == 3:
        units, _ = _units(module, params, layout)
        per_unit = (("all_gather", b), ("all_gather", b), ("reduce_scatter", 4))
        return [(kind, size * u.numel) for u in units for kind, size in per_unit], []
    if stage < 2 and not overlap:
        buckets = [Bucket(lo=0, hi=layout.padded_numel, params=())]
    else:
        buckets = buckets_by_size(module, params, layout, bucket_numel, segments)
    kind = "all_reduce" if stage == 0 else "reduce_scatter"
    reduced = [(kind, 4 * bucket.numel) for bucket in buckets]
    gathered = [] if stage == 0 else [("all_gather", b * layout.padded_numel)]
    return (reduced, gathered) if stage == 2 else ([], reduced + gathered)
