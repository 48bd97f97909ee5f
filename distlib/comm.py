"""Comm: which processes talk to each other, passed explicitly everywhere.

A Comm names a group of ranks (the whole world, a data-parallel group or a
tensor-parallel group) and this process's position in it. The collectives in
``distlib.collectives`` take a Comm instead of reaching for a global default,
so the same code serves every parallel layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Comm:
    ranks: tuple[int, ...]          # global ranks of the members, in group order
    rank: int                       # this process's index in ``ranks``
    group: object | None = None     # torch ProcessGroup; None means the default (world) group

    @property
    def size(self) -> int:
        return len(self.ranks)

    def peer(self, group_rank: int) -> int:
        """Global rank of the member at ``group_rank`` (point-to-point ops address global ranks)."""
        return self.ranks[group_rank % self.size]

    @staticmethod
    def world() -> "Comm":
        if not dist.is_initialized():
            return Comm(ranks=(0,), rank=0)
        return Comm(ranks=tuple(range(dist.get_world_size())), rank=dist.get_rank())

    @staticmethod
    def subgroup(ranks: list[int] | tuple[int, ...], group: object) -> "Comm":
        """Comm for an existing subgroup (created on every rank with ``dist.new_group``)."""
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of group {list(ranks)}")
        return Comm(ranks=tuple(ranks), rank=list(ranks).index(me), group=group)
