"""Global L2 norms of flat, partitioned, possibly tensor-parallel parameters or gradients.

A rank sees one data-parallel partition of its tensor-parallel shard of the model. The global
norm adds, per partition, two sums of squares: over the TP-split parameters, which differ between
tensor-parallel ranks and are summed over the TP group, and over the replicated ones, which are
identical bytes on every TP rank and so are counted once. The partitions' terms are combined in
rank order, so every rank computes the same float. With pipeline parallelism (``pp``: the group
of this rank's position at every stage, each stage holding other parameters) the stages' totals
are added in stage order last.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from distlib.comm import collectives
from distlib.comm.group import Comm
from distlib.parallel.flat_layout import FlatLayout


class NormTerms:
    """``dp``: the group the partitions are spread over; ``tp``: the tensor-parallel group (None or
    size 1 without tensor parallelism); ``tp_split``: names of the parameters split over it."""

    def __init__(
        self,
        layout: FlatLayout,
        dp: Comm,
        tp: Comm | None = None,
        tp_split: Collection[str] = (),
        pp: Comm | None = None,
    ):
        split = set(tp_split)
        unknown = split - {s.name for s in layout.slots}
        if unknown:
            raise ValueError(f"tensor-parallel split parameters not in the model: {sorted(unknown)}")
        self.dp, self.tp = dp, tp if tp is not None and tp.size > 1 else None
        self.pp = pp if pp is not None and pp.size > 1 else None
        # Per partition: (start, end, tp_split) runs of parameters, relative to the partition.
        self.segments: list[list[tuple[int, int, bool]]] = []
        for rank in range(dp.size):
            lo, hi = layout.shard_range(rank)
            runs = []
            for s in layout.slots:
                a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < b:
                    runs.append((a - lo, b - lo, s.name in split))
            self.segments.append(runs)

    def square_terms(self, part: torch.Tensor, rank: int) -> torch.Tensor:
        """[sum of squares over TP-split params, over replicated params] of partition ``rank``."""
        terms = torch.zeros(2, device=part.device)
        for a, b, is_split in self.segments[rank]:
            terms[0 if is_split else 1] += part[a:b].float().pow(2).sum()
        return terms

    def from_terms(self, terms: torch.Tensor) -> float:
        """terms: (N, 2) per partition, in rank order. Split params are summed over the TP group
        (collective over it); replicated ones are identical on every TP rank and counted once."""
        split_sq, replicated_sq = terms.sum(dim=0)
        if self.tp is not None:
            per_tp = torch.zeros(self.tp.size, device=terms.device)
            collectives.all_gather(per_tp, split_sq.reshape(1), self.tp)
            split_sq = per_tp.sum()
        total = split_sq + replicated_sq
        if self.pp is not None:
            per_stage = torch.zeros(self.pp.size, device=terms.device)
            collectives.all_gather(per_stage, total.reshape(1), self.pp)
            total = per_stage.sum()
        return float(total.sqrt())

    def of_partition(self, partition: torch.Tensor) -> float:
        """The global norm from this rank's partition (collective over dp, then tp)."""
        terms = torch.zeros(self.dp.size, 2, device=partition.device)
        collectives.all_gather(terms.view(-1), self.square_terms(partition, self.dp.rank), self.dp)
        return self.from_terms(terms)

    def of_full(self, flat: torch.Tensor) -> float:
        """The global norm from a rank's copy of every partition (collective over tp only)."""
        n = flat.numel() // self.dp.size
        return self.from_terms(
            torch.stack([self.square_terms(flat[r * n : (r + 1) * n], r) for r in range(self.dp.size)])
        )
