"""Gradients that each tensor-parallel rank holds a share of, summed over the group once per step.

A parameter every tensor-parallel rank holds whole but applies to its own share of the work gets
from each rank that share's gradient only: a norm's weight under sequence parallelism (the rank's
tokens), a per-head norm under tensor parallelism (the rank's heads, qwen3's q/k norms). The sum
over the group is the gradient. It is taken here, on the gradients the stage has averaged over its
data-parallel ranks (a sum and an average commute), once per step in one collective over ``tp``,
rather than in a hook on every backward (once per micro-batch and per parameter). Every rank of
``tp`` holds the same layout and partition bounds, so the pieces line up; the sum gives each of
them the same bytes, and the replicas stay equal.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from distlib.comm import collectives
from distlib.comm.group import Comm
from distlib.parallel.flat_layout import FlatLayout


class PartialSums:
    """The runs of ``names``' gradients inside the flat window [lo, hi) a stage's reduced gradients
    cover (all of the layout at stage 0, the rank's partition otherwise), relative to it."""

    def __init__(self, layout: FlatLayout, tp: Comm | None, names: Collection[str], window: tuple[int, int]):
        lo, hi = window
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.runs = []
        for s in layout.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if s.name in names and a < b:
                self.runs.append((a - lo, b - lo))

    @torch.no_grad()
    def sum_(self, grads: torch.Tensor) -> None:
        """Replace the runs of ``grads`` by their sums over ``tp`` (collective over it)."""
        if self.tp is None or not self.runs:  # alike on every rank of tp: same layout, same window
            return
        total = collectives.all_reduce(torch.cat([grads[a:b] for a, b in self.runs]), self.tp, op="sum")
        at = 0
        for a, b in self.runs:
            grads[a:b].copy_(total[at : at + b - a])
            at += b - a
