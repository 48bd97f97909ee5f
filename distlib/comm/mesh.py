"""The device mesh: the process groups of one world, built from its layout (distlib/comm/layout.py).

The layout owns the rank order; this module only asks it for each kind of group. The ranks of
one tensor-parallel group are neighbours (on real hardware, the GPUs of one node, where the
per-layer all-reduces are cheapest), and the ranks holding the same tensor shard at different
data-parallel positions form a data-parallel group, over which ZeRO shards the optimizer state.

``dist.new_group`` is itself collective: every rank must create every group, in
the same order, even the groups it does not belong to. That is why the whole
mesh is built here, in one place, once.

The dp and tp Comms carry the world Comm's ``check`` rider and its ``collectives`` choice, so the
subgroups' collectives are header-checked like the world's and run the same implementation, and,
when the world counts its traffic (``stats``), each gets a CommStats of its own: the bytes a rank
sends on the data-parallel group (gradient and parameter sync) and on the tensor-parallel group
(the layers' all-reduces) are then read apart, and the world's CommStats keeps only the
world-level collectives (the sum of the three is all the traffic). With dist.tp=1 the dp Comm
talks over the world's process group but still counts apart.

Context and expert parallelism add the groups they need only when their degree is above 1:
``batch``, the dp x cp ranks over which gradients are averaged and the loss is taken (the dp
group at cp = 1), and ``ep``/``edp``, the expert and expert-data-parallel groups (at ep = 1 a
group of one and the batch group).

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

from distlib.comm import local
from distlib.comm.group import Comm, CommStats
from distlib.comm.layout import BATCH, Layout, LayoutError

MeshError = LayoutError  # a parallel layout that cannot be built from this world


@dataclass(frozen=True)
class Mesh:
    world: Comm
    dp: Comm  # same tensor-parallel rank, every data-parallel position: ZeRO and data split here
    tp: Comm  # one data-parallel position, every tensor-parallel rank: attention/MLP shards
    pp: Comm | None = None  # one (dp, tp) position, every pipeline stage, in stage order
    stage: Comm | None = None  # every dp x tp rank of this rank's stage
    layout: Layout | None = None  # the grid the groups come from
    cp: Comm | None = None  # (cp > 1) one (pp, dp, tp) position, every context-parallel rank
    batch_: Comm | None = None  # (cp > 1) the dp x cp ranks; ``batch`` is the dp group otherwise
    ep: Comm | None = None  # (ep > 1) the ranks holding the other experts of the same layers
    edp: Comm | None = None  # (ep > 1) the ranks holding the same experts

    @property
    def batch(self) -> Comm:
        """The ranks that see other samples or other tokens of them (dp x cp): gradients are
        averaged over it and the loss is their mean."""
        return self.batch_ if self.batch_ is not None else self.dp

    @property
    def expert_dp(self) -> Comm:
        """The ranks over which the experts' gradients are averaged (the batch group at ep = 1)."""
        return self.edp if self.edp is not None else self.batch

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
            return self.batch.ranks
        at_last = self.layout.coords(self.world.rank) | {"pp": self.layout.pp - 1}
        return tuple(self.world.peer(r) for r in self.layout.group(self.layout.rank(**at_last), BATCH))

    def group(self, name: str) -> Comm:
        """The group of this rank named ``name``: a dimension (tp, dp, pp, cp, ep, edp), ``batch``
        or ``stage``; a dimension of degree 1 is this rank alone (dp and batch: as the mesh has them)."""
        found = {"batch": self.batch, "stage": self.stage, "edp": self.expert_dp, **self.groups()}
        if name in found and found[name] is not None:
            return found[name]
        if name in ("pp", "cp", "ep"):
            me = self.world.peer(self.world.rank)
            return Comm(ranks=(me,), rank=0)
        raise ValueError(f"unknown mesh group {name!r}")

    def groups(self) -> dict[str, Comm]:
        """The sub-groups by name (whose traffic the metrics report apart): each dimension's, and
        where they are groups of their own the batch group (cp > 1: the gradients' sync) and the
        stage (pp > 1: the replica check); at cp = 1 the batch group is dp, at pp = 1 the stage
        the world, counted as such."""
        kinds = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "edp": self.edp}
        kinds |= {"batch": self.batch_, "stage": self.stage if self.stage is not self.world else None}
        return {kind: comm for kind, comm in kinds.items() if comm is not None}


def _new_group(ranks: list[int], timeout_s: float | None):
    """A torch process group; ``timeout_s``: its waits' bound (torch's default for a new gloo group
    is 30 minutes, not the world's ``dist.timeout_s``: a stalled peer would not be detected)."""
    if timeout_s is None:
        return dist.new_group(ranks)
    return dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))


# the groups a mesh builds, by kind: the layout dimensions each spans, and the degree above 1 that
# calls for it (None: always)
KINDS = {
    "tp": (("tp",), None),
    "dp": (("dp",), None),
    "pp": (("pp",), "pp"),
    "stage": (("dp", "cp", "tp"), "pp"),
    "cp": (("cp",), "cp"),
    "batch_": (BATCH, "cp"),
    "ep": (("ep",), "ep"),
    "edp": (("edp",), "ep"),
}


def build_mesh(
    world: Comm, layout: Layout, timeout_s: float | None = None, hosts: list[str] | None = None
) -> Mesh:
    """Create the data- and tensor-parallel groups of ``world`` (collective: call on every rank) for
    ``layout`` (``Layout.of``, over ``world``'s ranks), and the groups of each other dimension whose
    degree is above 1; each waits at most ``timeout_s``. With ``hosts`` (``local.host_keys``, by
    global rank) every group whose members share a host gets a shared-memory segment, as does each
    group of a world that has one; the others keep gloo's pairs."""
    if layout.world_size != world.size:
        raise MeshError(f"a layout of {layout.world_size} ranks for a group of {world.size}")

    def riders() -> dict:
        return dict(
            stats=CommStats() if world.stats is not None else None,
            check=world.check,
            device=world.device,
            collectives=world.collectives,
        )

    me = world.rank
    mine: dict[str, Comm] = {}
    for kind, (dims, degree) in KINDS.items():
        if degree is not None and getattr(layout, degree) == 1:
            continue
        for group_ranks in layout.groups(dims):
            ranks = [world.peer(r) for r in group_ranks]
            if kind == "dp" and len(ranks) == world.size:  # the whole world: its own process group
                mine[kind] = dataclasses.replace(world, **riders())
                continue
            # gloo needs a real group even of size 1 only for collectives; skip those.
            group = _new_group(ranks, timeout_s) if len(ranks) > 1 else None
            if me in group_ranks:
                base = Comm.subgroup(ranks, group) if group is not None else Comm(ranks=tuple(ranks), rank=0)
                mine[kind] = dataclasses.replace(base, **riders())
    if world.transport is not None or hosts is not None:
        # a world with a segment shares one host, so does each of its groups; otherwise the hosts
        # say which do. In KINDS order on every rank: no two members wait in different groups.
        wait_s = world.transport.timeout_s if world.transport is not None else timeout_s or 1800.0
        for kind, comm in mine.items():
            if comm.transport is None:
                mine[kind] = local.attach(comm, hosts, wait_s)
    if layout.pp == 1:
        mine["stage"] = world
    return Mesh(world=world, layout=layout, **mine)


def shape_mesh(layout: Layout, rank: int) -> Mesh:
    """The mesh global rank ``rank`` of ``layout`` builds, its groups naming their ranks only: no
    process group, and dry (``Comm.dry``: a collective moves nothing). What a rank holds, and
    what its forward keeps, follow from it without starting any process (``distlib.app.plan``)."""
    world = Comm(ranks=tuple(range(layout.world_size)), rank=rank, dry=True)
    mine: dict[str, Comm] = {}
    for kind, (dims, degree) in KINDS.items():
        if degree is None or getattr(layout, degree) > 1:
            ranks = layout.group(rank, dims)
            mine[kind] = Comm(ranks=tuple(ranks), rank=ranks.index(rank), dry=True)
    if layout.pp == 1:
        mine["stage"] = world
    return Mesh(world=world, layout=layout, **mine)
