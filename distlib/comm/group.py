"""Comm: which processes talk to each other, passed explicitly everywhere.

A Comm names a group of ranks (the whole world, a data-parallel group or a
tensor-parallel group) and this process's position in it. The collectives in
``distlib.collectives`` take a Comm instead of reaching for a global default,
so the same code serves every parallel layout.

Two optional riders travel with a Comm (both off by default, so benchmarks and
tests see the bare collectives): ``stats``, a ``CommStats`` that counts calls,
bytes sent and seconds per collective kind for this rank, and ``check``, which
makes every collective carry a small header (kind, size, dtype, op,
call number) so ranks that call mismatched collectives get a descriptive error
instead of a hang, an abort inside gloo or silently truncated data.

``device`` is where the group's messages travel: "cpu" for gloo, "cuda:<k>" for NCCL. A tensor
elsewhere is staged through a buffer there (``p2p.P2P``): CUDA tensors over gloo go through
pinned host memory, which is how several ranks share one GPU.

``collectives`` says whose collectives the group's calls run: "ours" (``distlib.comm.algorithms``,
on point-to-point messages) or "torch" (torch.distributed's own on ``group``, e.g. NCCL's kernels:
``native``). Callers never branch on it; subgroups built by ``mesh.build_mesh`` inherit it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

# The collective kinds counted separately; anything else is counted as "other".
KINDS = ("broadcast", "reduce_scatter", "all_gather", "all_reduce", "all_gather_bytes", "other", "all_to_all")
# Whose collectives a Comm runs (the first is the default).
COLLECTIVES = ("ours", "torch")
# What carries our messages between the members of a group on one host (the first is the default):
# a shared-memory segment (``shm``) or the process group's gloo pairs.
TRANSPORTS = ("shm", "gloo")


class CommStats:
    """Per collective kind: calls, bytes this rank sent, seconds spent (outermost calls only,
    so an all_reduce built from reduce_scatter + all_gather counts once, as an all_reduce)."""

    def __init__(self) -> None:
        self.calls = dict.fromkeys(KINDS, 0)
        self.bytes_sent = dict.fromkeys(KINDS, 0)
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.depth = 0  # > 0 while inside a collective
        self.current = "other"  # kind of the outermost collective in progress

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def as_vector(self) -> list[float]:
        """calls, bytes, seconds for each kind in KINDS order (for a fixed-width gather)."""
        return [float(x) for k in KINDS for x in (self.calls[k], self.bytes_sent[k], self.seconds[k])]


@dataclass(frozen=True)
class Comm:
    ranks: tuple[int, ...]  # global ranks of the members, in group order
    rank: int  # this process's index in ``ranks``
    group: object | None = None  # torch ProcessGroup; None means the default (world) group
    stats: CommStats | None = dataclasses.field(default=None, compare=False)
    check: bool = False  # exchange a header before each collective (see module doc)
    device: str = "cpu"  # where messages travel: "cpu" (gloo) or "cuda:<k>" (NCCL)
    collectives: str = COLLECTIVES[0]  # whose collectives run (see module doc)
    # the members' shared-memory segment (``shm.Transport``), where they share a host; None: gloo
    transport: object | None = dataclasses.field(default=None, compare=False)
    # a planning group (``mesh.shape_mesh``): its collectives and messages move nothing, and what
    # they return has the shape a real group's would (the planner runs forwards on the meta device)
    dry: bool = False

    def __post_init__(self) -> None:
        if self.collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {list(COLLECTIVES)}, got {self.collectives!r}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def peer(self, group_rank: int) -> int:
        """Global rank of the member at ``group_rank`` (point-to-point ops address global ranks)."""
        return self.ranks[group_rank % self.size]

    def instrumented(self, check: bool, collectives: str | None = None) -> Comm:
        """This group with a fresh CommStats, the given header-check setting and, if given, whose
        collectives it runs."""
        chosen = collectives if collectives is not None else self.collectives
        return dataclasses.replace(self, stats=CommStats(), check=check, collectives=chosen)

    @property
    def batched(self) -> bool:
        """Whether a round's sends and receives must be posted together (NCCL: one batch per
        round, or two ranks' unbatched send/recv pairs can wait on each other forever)."""
        return self.device != "cpu"

    @staticmethod
    def world(device: str = "cpu") -> Comm:
        if not dist.is_initialized():
            return Comm(ranks=(0,), rank=0, device=device)
        return Comm(ranks=tuple(range(dist.get_world_size())), rank=dist.get_rank(), device=device)

    @staticmethod
    def subgroup(ranks: list[int] | tuple[int, ...], group: object, device: str = "cpu") -> Comm:
        """Comm for an existing subgroup (created on every rank with ``dist.new_group``)."""
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of group {list(ranks)}")
        return Comm(ranks=tuple(ranks), rank=list(ranks).index(me), group=group, device=device)
