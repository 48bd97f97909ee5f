"""Gradients each tensor-parallel rank holds a share of, summed over the group once per step
(distlib/parallel/zero/partial_sums.py): on 4 gloo ranks (2 data- x 2 tensor-parallel), every
window a stage can hand it -- the whole layout (stage 0), each partition, partitions that hold
none of the partial parameters, a parameter cut by a partition's edge -- comes back with exactly
those elements summed over the tensor-parallel pair and every other element untouched.
The layouts' whole runs (sequence-parallel norms, qwen3's q/k norms) are
tests/test_sequence_parallel.py's and tests/test_families_train.py's."""

from __future__ import annotations

import pytest
import torch
from multiproc import run_ranks

from distlib.comm.layout import Layout
from distlib.comm.mesh import build_mesh
from distlib.parallel.flat_layout import FlatLayout, ParamSlot
from distlib.parallel.zero.partial_sums import PartialSums

# 9 + 5 + 6 + 3 = 23 elements over 4 partitions of 6 (1 padding): "norm" spans partitions 1 and 2,
# "bias" is the last run of partition 3, and partition 0 holds no partial parameter.
SLOTS = [("w", (9,)), ("norm", (5,)), ("v", (2, 3)), ("bias", (3,))]
PARTIAL = {"norm", "bias"}


def _layout(n: int) -> FlatLayout:
    slots, at = [], 0
    for name, shape in SLOTS:
        slots.append(ParamSlot(name, shape, at))
        at += torch.Size(shape).numel()
    return FlatLayout(tuple(slots), n)


def _grads(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))


def _sum_windows(comm, n: int):
    mesh = build_mesh(comm, Layout.of(comm.size, tp=2))
    layout = _layout(n)
    out = []
    for window in [(0, layout.padded_numel)] + [layout.shard_range(r) for r in range(n)]:
        grads = _grads(comm.rank, layout.padded_numel)[slice(*window)].clone()
        PartialSums(layout, mesh.tp, PARTIAL, window).sum_(grads)
        out.append((window, grads.numpy().copy()))
    return mesh.tp.ranks, out


@pytest.mark.parametrize("n", [4, 1])
def test_the_partial_elements_of_every_window_are_summed_over_tp_and_nothing_else(n):
    results = run_ranks(_sum_windows, 4, n)
    layout = _layout(n)
    partial = torch.zeros(layout.padded_numel, dtype=torch.bool)
    for s in layout.slots:
        partial[s.offset : s.offset + s.numel] = s.name in PARTIAL
    for rank, (tp_ranks, windows) in enumerate(results):
        assert len(tp_ranks) == 2 and rank in tp_ranks
        whole = sum(_grads(r, layout.padded_numel) for r in tp_ranks)  # the two ranks' sum
        for (lo, hi), got in windows:
            got, mask = torch.from_numpy(got), partial[lo:hi]
            want = torch.where(mask, whole[lo:hi], _grads(rank, layout.padded_numel)[lo:hi])
            assert torch.equal(got, want), f"rank {rank} window {(lo, hi)}"
    if n == 4:  # the windows the test means to cover are there
        covers = [partial[slice(*layout.shard_range(r))].any().item() for r in range(4)]
        assert covers == [False, True, True, True]


def test_without_a_tensor_parallel_group_nothing_changes():
    layout = _layout(1)
    grads = _grads(0, layout.padded_numel)
    PartialSums(layout, None, PARTIAL, (0, layout.padded_numel)).sum_(grads)
    assert torch.equal(grads, _grads(0, layout.padded_numel))
