"""The parallel layout: named dimensions over the world's ranks, and the one rank order.

A world of ``pp x dp x cp x tp`` ranks is a grid (picotron's ``arange(world).view(...)``) whose
dimensions, slowest-varying first, are ``ORDER``::

    global rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Tensor-parallel ranks are neighbours (on real hardware the GPUs of one node, where the per-layer
all-reduces are cheapest); a pipeline stage is a contiguous block of ranks. ``cp`` (context
parallelism: the ranks sharing one sequence) sits next to them. ``ep`` (expert parallelism) is a
dimension of its own order over the same ranks: it splits the batch ranks dp x cp into groups
holding other experts and adds no ranks. The dimensions a run sets are declared once
(``DIMENSIONS``: name, config key, grid or split); checks, records and groups follow from it.
Everything that needs a rank from coordinates or the ranks of a group asks this object: nothing
else in the package computes a rank from the sizes (``tests/test_layering.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

ORDER = ("pp", "dp", "cp", "tp")  # the grid's dimensions, slowest-varying first
BATCH = ("dp", "cp")  # the ranks that see other samples or other tokens of them: gradients average here
EXPERT = ("ep", "edp")  # the expert and expert-data-parallel groups, splits of the batch group


@dataclass(frozen=True)
class Dimension:
    """A parallel dimension a run sets: its name (the layout's field, the mesh's group), the config
    key of its degree, and ``over``: empty for a dimension of the world's grid (its ranks multiply
    the world), else the grid dimensions whose ranks it splits without adding any (experts: the batch)."""

    name: str
    key: str
    over: tuple[str, ...] = ()


# Every dimension a run sets, once, in the order their keys are named (dp is not set: it is what the
# world leaves after the grid's). A new dimension is declared here and placed in ORDER (or given
# ``over``); the mesh builds its groups from the layout, a manifest records it by name.
DIMENSIONS = (
    Dimension("tp", "dist.tp"),
    Dimension("pp", "dist.pp"),
    Dimension("cp", "dist.cp"),
    Dimension("ep", "dist.ep", over=BATCH),
)
NAMES = ORDER + tuple(d.name for d in DIMENSIONS if d.over)  # every degree a layout has, as recorded


class LayoutError(ValueError):
    """A parallel layout that this world size cannot hold."""


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @staticmethod
    def of(world_size: int, **degrees: int) -> Layout:
        """The layout of ``world_size`` ranks with these degrees (by dimension name; dp is what is
        left), checked: one line naming the keys for each way it cannot be built."""
        unknown = set(degrees) - {d.name for d in DIMENSIONS}
        if unknown:
            raise ValueError(f"unknown layout dimension(s) {sorted(unknown)}")
        sizes = {d.name: degrees.get(d.name, 1) for d in DIMENSIONS}
        for d in DIMENSIONS:
            if not isinstance(sizes[d.name], int) or sizes[d.name] < 1:
                raise LayoutError(f"{d.key} must be an integer >= 1, got {sizes[d.name]!r}")
        grid = [d for d in DIMENSIONS if not d.over]
        product = math.prod(sizes[d.name] for d in grid)
        if world_size < 1 or world_size % product:
            raise LayoutError(f"{_product(grid, sizes)} must be >= 1 and divide dist.world_size={world_size}")
        layout = Layout(dp=world_size // product, **sizes)
        for d in DIMENSIONS:
            ranks = math.prod(getattr(layout, g) for g in d.over)
            if d.over and ranks % sizes[d.name]:
                raise LayoutError(
                    f"{d.key}={sizes[d.name]} must divide the batch ranks {' x '.join(d.over)} = {ranks}"
                )
        return layout

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def sizes(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in ORDER}

    def rank(self, **coords: int) -> int:
        """The global rank at these coordinates (a dimension not named is at 0)."""
        unknown = set(coords) - set(ORDER)
        if unknown:
            raise ValueError(f"unknown layout dimension(s) {sorted(unknown)}")
        rank = 0
        for dim in ORDER:
            at, size = coords.get(dim, 0), getattr(self, dim)
            if not 0 <= at < size:
                raise ValueError(f"{dim} coordinate {at} outside 0..{size - 1}")
            rank = rank * size + at
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        out = {}
        for dim in reversed(ORDER):
            rank, out[dim] = divmod(rank, getattr(self, dim))
        return {dim: out[dim] for dim in ORDER}

    def group(self, rank: int, dims: tuple[str, ...]) -> tuple[int, ...]:
        """The ranks that share ``rank``'s coordinates outside ``dims``, in rank order (a group over
        several dimensions, e.g. ("dp", "cp") for the batch, is their flattening). ``("ep",)`` and
        ``("edp",)`` are the expert groups, which split the batch group rather than the world:
        with ``b`` a rank's place in its batch group, the expert group holds the ``ep`` consecutive
        places ``b // ep`` shares (each holding other experts; neighbours, so that the tokens'
        all-to-all stays close), the expert-data-parallel group the places ``b % ep`` shares (the
        same experts, over which their gradients are averaged). An expert group with ``"tp"``
        joins that group of every tensor-parallel rank (the ranks holding the same experts whole)."""
        if set(dims) - set(ORDER) - set(EXPERT):
            raise ValueError(f"unknown layout dimension(s) {sorted(set(dims) - set(ORDER) - set(EXPERT))}")
        if set(dims) & set(EXPERT):
            expert = [d for d in dims if d in EXPERT]
            if len(expert) != 1 or set(dims) - {expert[0], "tp"}:
                raise ValueError(f"an expert group takes only tp beside it, not {dims}")
            if "tp" in dims:
                peers = self.group(rank, ("tp",))
                return tuple(sorted(r for peer in peers for r in self.group(peer, (expert[0],))))
            batch = self.group(rank, BATCH)
            b = batch.index(rank)
            if dims == ("ep",):
                return batch[b - b % self.ep : b - b % self.ep + self.ep]
            return batch[b % self.ep :: self.ep]
        fixed = {d: c for d, c in self.coords(rank).items() if d not in dims}
        free = [d for d in ORDER if d in dims]
        spans = [range(getattr(self, d)) for d in free]
        return tuple(sorted(self.rank(**fixed, **dict(zip(free, at))) for at in itertools.product(*spans)))

    def place(self, rank: int, dims: tuple[str, ...]) -> int:
        """``rank``'s index in its group over ``dims``."""
        return self.group(rank, dims).index(rank)

    def groups(self, dims: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Every group over ``dims``, partitioning the world, ordered by their first rank."""
        return sorted({self.group(r, dims) for r in range(self.world_size)})

    def partitions(self) -> Layout:
        """The same ranks with the batch dimensions as one (dp x cp, cp 1): ZeRO partitions a flat
        layout over the batch group, so a checkpoint's shards are found as if dp were dp x cp. The
        rank order is the same: ((pp * dp + d) * cp + c) * tp + t = (pp * dp * cp + b) * tp + t with
        b = d * cp + c, the place in the batch group."""
        return Layout(pp=self.pp, dp=self.dp * self.cp, cp=1, tp=self.tp, ep=self.ep)

    def stage(self) -> Layout:
        """One pipeline stage's ranks as a layout of their own (pp 1), numbered as the stage group
        numbers them: the same dp, cp, tp and expert groups, in the same order."""
        return dataclasses.replace(self, pp=1)

    def to_dict(self) -> dict:
        """For manifests: the degrees by name and the order (``from_dict`` reads it back)."""
        return {"order": list(ORDER), **{name: getattr(self, name) for name in NAMES}}

    @staticmethod
    def from_dict(record: dict) -> Layout:
        if list(record.get("order", ORDER)) != list(ORDER):
            raise LayoutError(f"rank order {record['order']} is not this code's {list(ORDER)}")
        return Layout(**{name: int(record.get(name, 1)) for name in NAMES})

    @staticmethod
    def of_manifest(manifest: dict) -> Layout:
        """A checkpoint's layout: its ``parallel`` record, or (manifests written before it) the
        world size, ``tp`` and ``pp`` it always had, in the same order."""
        if "parallel" in manifest:
            return Layout.from_dict(manifest["parallel"])
        return Layout.of(
            int(manifest["world_size"]), tp=int(manifest.get("tp", 1)), pp=int(manifest.get("pp", 1))
        )


def _product(grid: list[Dimension], sizes: dict[str, int]) -> str:
    """The grid keys set above 1 (tp when none is) and their product, as an error names them."""
    split = {d.key: sizes[d.name] for d in grid if sizes[d.name] > 1} or {grid[0].key: sizes[grid[0].name]}
    if len(split) == 1:
        return "".join(f"{k}={v}" for k, v in split.items())
    return f"{' x '.join(split)} = {' x '.join(map(str, split.values()))}"
