"""The 2-D device mesh: data-parallel x tensor-parallel groups of one world.

Global rank ``g = dp_rank * tp + tp_rank``: the ranks of one tensor-parallel
group are neighbours (on real hardware, the GPUs of one node, where the
per-layer all-reduces are cheapest), and the ranks holding the same tensor
shard at different data-parallel positions form a data-parallel group, over
which ZeRO shards the optimizer state.

``dist.new_group`` is itself collective: every rank must create every group, in
the same order, even the groups it does not belong to. That is why the whole
mesh is built here, in one place, once.

The dp and tp Comms carry the world Comm's ``check`` rider, so the subgroups' collectives are
header-checked like the world's, and, when the world counts its traffic (``stats``), each gets a
CommStats of its own: the bytes a rank sends on the data-parallel group (gradient and parameter
sync) and on the tensor-parallel group (the layers' all-reduces) are then read apart, and the
world's CommStats keeps only the world-level collectives (the sum of the three is all the
traffic). With dist.tp=1 the dp Comm talks over the world's process group but still counts apart.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from distlib.comm.group import Comm, CommStats


class MeshError(ValueError):
    """A parallel layout that cannot be built from this world."""


@dataclass(frozen=True)
class Mesh:
    world: Comm
    dp: Comm    # same tensor-parallel rank, every data-parallel position: ZeRO and data split here
    tp: Comm    # one data-parallel position, every tensor-parallel rank: attention/MLP shards


def check_layout(world_size: int, tp: int) -> None:
    if tp < 1 or world_size % tp:
        raise MeshError(f"dist.tp={tp} must be >= 1 and divide dist.world_size={world_size}")


def build_mesh(world: Comm, tp: int) -> Mesh:
    """Create the data- and tensor-parallel groups of ``world`` (collective: call on every rank)."""
    check_layout(world.size, tp)

    def riders() -> dict:
        return dict(stats=CommStats() if world.stats is not None else None, check=world.check,
                    device=world.device)

    if tp == 1:
        return Mesh(world=world, dp=dataclasses.replace(world, **riders()),
                    tp=Comm(ranks=(world.peer(world.rank),), rank=0, **riders()))
    dp_size = world.size // tp
    tp_groups = [[world.peer(d * tp + t) for t in range(tp)] for d in range(dp_size)]
    dp_groups = [[world.peer(d * tp + t) for d in range(dp_size)] for t in range(tp)]
    me = world.peer(world.rank)
    mine: dict[str, Comm] = {}
    for kind, groups in (("tp", tp_groups), ("dp", dp_groups)):
        for ranks in groups:
            # gloo needs a real group even of size 1 only for collectives; skip those.
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if me in ranks:
                mine[kind] = dataclasses.replace(Comm.subgroup(ranks, group) if group is not None
                                                 else Comm(ranks=tuple(ranks), rank=0), **riders())
    return Mesh(world=world, dp=mine["dp"], tp=mine["tp"])
