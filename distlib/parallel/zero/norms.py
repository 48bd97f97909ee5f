"""Global L2 norms of flat, partitioned, possibly tensor-parallel parameters or gradients.

A rank sees one data-parallel partition of its share of the model. Parameters are of *kinds*,
named by the groups whose ranks hold different values of them: a tensor-parallel split parameter
differs over the tp group, an expert's weights over the expert group, a replicated parameter over
none (identical bytes on every rank of those groups, so counted once). Per partition the norm
adds one sum of squares per kind; a kind's sum is then added over each of its groups, the kinds
are added in their order (the split ones first, the replicated last), and with pipeline
parallelism (``pp``: the group of this rank's position at every stage, each stage holding other
parameters) the stages' totals in stage order last. Every step runs in rank order, so every rank
computes the same float.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from distlib.comm import collectives
from distlib.comm.group import Comm
from distlib.parallel.flat_layout import FlatLayout


def _sum_over(value: torch.Tensor, comm: Comm | None) -> torch.Tensor:
    """``value`` summed over ``comm``'s ranks, in rank order (collective over it)."""
    if comm is None or comm.size == 1:
        return value
    each = torch.zeros(comm.size, device=value.device)
    collectives.all_gather(each, value.reshape(1), comm)
    return each.sum()


class NormTerms:
    """``dp``: the group the partitions are spread over; ``differs_over``: parameter name -> the
    groups whose ranks hold different values of it (a name not listed is replicated), to which the
    tensor-parallel group ``tp`` is added for the parameters ``tp_split`` names."""

    def __init__(
        self,
        layout: FlatLayout,
        dp: Comm,
        differs_over: Mapping[str, tuple[Comm, ...]] | None = None,
        pp: Comm | None = None,
        *,
        tp: Comm | None = None,
        tp_split: Collection[str] = (),
    ):
        over = {name: (tp,) for name in tp_split} if tp is not None else {}
        for name, groups in (differs_over or {}).items():
            over[name] = over.get(name, ()) + tuple(groups)
        differs_over = {n: tuple(c for c in g if c.size > 1) for n, g in over.items()}
        unknown = set(differs_over) - {s.name for s in layout.slots}
        if unknown:
            raise ValueError(f"split parameters not in the model: {sorted(unknown)}")
        # The kinds: the split ones in order of first appearance, then the replicated one.
        self.kinds = list(dict.fromkeys(g for g in differs_over.values() if g)) + [()]
        kind_of = {name: self.kinds.index(groups) for name, groups in differs_over.items()}
        self.dp, self.pp = dp, pp if pp is not None and pp.size > 1 else None
        # Per partition: (start, end, kind) runs of parameters, relative to the partition.
        self.segments: list[list[tuple[int, int, int]]] = []
        for rank in range(dp.size):
            lo, hi = layout.shard_range(rank)
            runs = []
            for s in layout.slots:
                a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < b:
                    runs.append((a - lo, b - lo, kind_of.get(s.name, len(self.kinds) - 1)))
            self.segments.append(runs)

    def square_terms(self, part: torch.Tensor, rank: int) -> torch.Tensor:
        """The sum of squares per kind of partition ``rank``."""
        terms = torch.zeros(len(self.kinds), device=part.device)
        for a, b, kind in self.segments[rank]:
            terms[kind] += part[a:b].float().pow(2).sum()
        return terms

    def squares_from_terms(self, terms: torch.Tensor) -> torch.Tensor:
        """terms: (N, kinds) per partition, in rank order -> this stage's sum of squares: each kind
        summed over the groups its values differ over (collectives over them), the kinds added."""
        per_kind = terms.sum(dim=0)
        total = None
        for k, groups in enumerate(self.kinds):
            value = per_kind[k]
            for comm in groups:
                value = _sum_over(value, comm)
            total = value if total is None else total + value
        return total

    def finish(self, squares: torch.Tensor) -> float:
        """The norm from this stage's sum of squares: the stages' added (collective over pp)."""
        return float(_sum_over(squares, self.pp).sqrt())

    def squares_of_partition(self, partition: torch.Tensor) -> torch.Tensor:
        """This stage's sum of squares from this rank's partition (collective over dp, then the kinds')."""
        terms = torch.zeros(self.dp.size, len(self.kinds), device=partition.device)
        collectives.all_gather(terms.view(-1), self.square_terms(partition, self.dp.rank), self.dp)
        return self.squares_from_terms(terms)

    def squares_of_full(self, flat: torch.Tensor) -> torch.Tensor:
        """This stage's sum of squares from a rank's copy of every partition (no collective over dp)."""
        n = flat.numel() // self.dp.size
        terms = torch.stack([self.square_terms(flat[r * n : (r + 1) * n], r) for r in range(self.dp.size)])
        return self.squares_from_terms(terms)
