"""The 3-D device mesh: data-parallel x tensor-parallel x pipeline groups of one world.

Global rank ``g = (pp_rank * dp + dp_rank) * tp + tp_rank``: tensor-parallel fastest, then
data-parallel, then pipeline stage (with ``pp`` = 1 this is the 2-D ``dp_rank * tp + tp_rank``).
The ranks of one tensor-parallel
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

Pipeline parallelism (``pp`` > 1) adds ``pp``: the ranks with this rank's (dp, tp) position at
every stage, in stage order (activations and their gradients travel between neighbours in it:
``prev``/``next``), and ``stage``: the dp x tp ranks of this rank's stage (what the replica check
compares). The dp and tp groups then lie inside one stage. With pp = 1, ``stage`` is the world
and ``pp`` a group of one.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch.distributed as dist

from distlib.comm.group import Comm, CommStats


class MeshError(ValueError):
    """A parallel layout that cannot be built from this world."""


@dataclass(frozen=True)
class Mesh:
    world: Comm
    dp: Comm  # same tensor-parallel rank, every data-parallel position: ZeRO and data split here
    tp: Comm  # one data-parallel position, every tensor-parallel rank: attention/MLP shards
    pp: Comm | None = None  # one (dp, tp) position, every pipeline stage, in stage order
    stage: Comm | None = None  # every dp x tp rank of this rank's stage

    @property
    def first_stage(self) -> bool:
        return self.pp is None or self.pp.rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp is None or self.pp.rank == self.pp.size - 1

    @property
    def loss_ranks(self) -> tuple[int, ...]:
        """Global ranks whose mean is the step's loss: this rank's data-parallel group, moved to the
        last stage (where the loss is computed)."""
        if self.pp is None:
            return self.dp.ranks
        shift = (self.pp.size - 1 - self.pp.rank) * (self.world.size // self.pp.size)
        return tuple(r + shift for r in self.dp.ranks)

    def groups(self) -> dict[str, Comm]:
        """The sub-groups by name (whose traffic the metrics report apart)."""
        return {"dp": self.dp, "tp": self.tp, **({"pp": self.pp} if self.pp is not None else {})}


def check_layout(world_size: int, tp: int, pp: int = 1) -> None:
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        what = f"dist.tp={tp}" if pp == 1 else f"dist.tp x dist.pp = {tp} x {pp}"
        raise MeshError(f"{what} must be >= 1 and divide dist.world_size={world_size}")


def _new_group(ranks: list[int], timeout_s: float | None):
    """A torch process group; ``timeout_s``: its waits' bound (torch's default for a new gloo group
    is 30 minutes, not the world's ``dist.timeout_s``: a stalled peer would not be detected)."""
    if timeout_s is None:
        return dist.new_group(ranks)
    return dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))


def build_mesh(world: Comm, tp: int, pp: int = 1, timeout_s: float | None = None) -> Mesh:
    """Create the data- and tensor-parallel groups of ``world`` (collective: call on every rank),
    and with ``pp`` > 1 the pipeline and stage groups; each waits at most ``timeout_s``."""
    check_layout(world.size, tp, pp)
    if pp > 1:
        return _build_3d(world, tp, pp, timeout_s)

    def riders() -> dict:
        return dict(
            stats=CommStats() if world.stats is not None else None, check=world.check, device=world.device
        )

    if tp == 1:
        return Mesh(
            world=world,
            dp=dataclasses.replace(world, **riders()),
            tp=Comm(ranks=(world.peer(world.rank),), rank=0, **riders()),
            stage=world,
        )
    dp_size = world.size // tp
    tp_groups = [[world.peer(d * tp + t) for t in range(tp)] for d in range(dp_size)]
    dp_groups = [[world.peer(d * tp + t) for d in range(dp_size)] for t in range(tp)]
    me = world.peer(world.rank)
    mine: dict[str, Comm] = {}
    for kind, groups in (("tp", tp_groups), ("dp", dp_groups)):
        for ranks in groups:
            # gloo needs a real group even of size 1 only for collectives; skip those.
            group = _new_group(ranks, timeout_s) if len(ranks) > 1 else None
            if me in ranks:
                mine[kind] = dataclasses.replace(
                    Comm.subgroup(ranks, group) if group is not None else Comm(ranks=tuple(ranks), rank=0),
                    **riders(),
                )
    return Mesh(world=world, dp=mine["dp"], tp=mine["tp"], stage=world)


def _build_3d(world: Comm, tp: int, pp: int, timeout_s: float | None) -> Mesh:
    dp = world.size // (tp * pp)
    g = lambda s, d, t: world.peer((s * dp + d) * tp + t)  # noqa: E731 - the rank order, once
    groups = {
        "tp": [[g(s, d, t) for t in range(tp)] for s in range(pp) for d in range(dp)],
        "dp": [[g(s, d, t) for d in range(dp)] for s in range(pp) for t in range(tp)],
        "pp": [[g(s, d, t) for s in range(pp)] for d in range(dp) for t in range(tp)],
        "stage": [[g(s, d, t) for d in range(dp) for t in range(tp)] for s in range(pp)],
    }
    me = world.peer(world.rank)
    mine: dict[str, Comm] = {}
    for kind, lists in groups.items():
        for ranks in lists:
            group = _new_group(ranks, timeout_s) if len(ranks) > 1 else None
            if me in ranks:
                stats = CommStats() if world.stats is not None else None
                base = Comm.subgroup(ranks, group) if group is not None else Comm(ranks=tuple(ranks), rank=0)
                mine[kind] = dataclasses.replace(base, stats=stats, check=world.check, device=world.device)
    return Mesh(world=world, **mine)
