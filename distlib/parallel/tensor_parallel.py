"""Megatron-style tensor parallelism by swapping a module's layers for this rank's shards.

``parallelize_(module, tp, plan)`` replaces, in place, each submodule whose path matches a pattern
of ``plan`` with this rank's shard of it (the way picotron does it): the model keeps its own
forward arithmetic and only sees narrower layers. A module that declares how it splits
(``DeclaresSplit``: a fused layer, a layer of experts) makes its own shard; an ``nn.Linear`` is
split by the plan's style. With T tensor-parallel ranks,

  ``Column()``          ColumnParallelLinear: rank t holds output features [t*F/T, (t+1)*F/T)
                        (rows of the weight, and of the bias); its output is split too;
  ``Column(groups=3)``  the same for a fused q|k|v projection: each of the 3 groups of output
                        rows is split, so rank t holds the q, k and v rows of its heads;
  ``Row()``             RowParallelLinear: rank t holds input features [t*F/T, (t+1)*F/T)
                        (columns of the weight); the partial outputs are summed over the group;
  ``Shared()``          for a ``SharedInput`` (no parameters): an activation that enters the
                        region the way a column layer's input does (MLA's rotary key).

A column-parallel layer followed by a row-parallel one is one Megatron half (attention, MLP):
the replicated input enters through ``copy_to_tp`` (identity forward, all-reduce of the input
gradient backward) and the partial outputs leave through ``reduce_from_tp`` (all-reduce forward,
identity backward), both with the hand-written collectives on the TP group. The row-parallel
bias is replicated and added once, after the sum. With sequence parallelism (``dist.sp``,
``sequence_parallel``) the input arrives gathered along the sequence instead, and the partial
outputs are reduce-scattered along it.

Everything else (embeddings, LayerNorms, LM head) is replicated. Its inputs are identical bytes on
every TP rank (they come out of an all-reduce) and so are its gradients, so replicated parameters
stay bitwise equal across TP ranks without any extra communication (tests/test_parallel.py
checks it).

Parameter names are the unsharded model's; only the shapes shrink. ``Split`` records how a local
parameter maps to the full one, which the checkpoint manifest stores and ``shard_of`` applies.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlib.comm import collectives
from distlib.comm.group import Comm
from distlib.parallel.sequence_parallel import SequenceSplit


@dataclass(frozen=True)
class Split:
    """Local = the ``index``-th of ``parts`` equal pieces of each of ``groups`` equal groups of
    the full tensor along ``dim``, concatenated (``groups`` is 3 for the fused q|k|v rows)."""

    dim: int
    parts: int
    index: int
    groups: int = 1

    def to_dict(self) -> dict:
        return {"dim": self.dim, "parts": self.parts, "index": self.index, "groups": self.groups}


def shard_of(full: torch.Tensor, split: Split | None) -> torch.Tensor:
    """The piece of ``full`` a rank with ``split`` holds (a copy; the whole tensor if None)."""
    if split is None:
        return full.clone()
    pieces = [
        g.chunk(split.parts, dim=split.dim)[split.index] for g in full.chunk(split.groups, dim=split.dim)
    ]
    return torch.cat(pieces, dim=split.dim).contiguous()


def unshard(pieces: list[torch.Tensor], dim: int, groups: int = 1) -> torch.Tensor:
    """The full tensor from every rank's ``shard_of`` piece, in split-index order (its inverse)."""
    per_group = [piece.chunk(groups, dim=dim) for piece in pieces]
    return torch.cat([torch.cat([p[g] for p in per_group], dim=dim) for g in range(groups)], dim=dim)


def _all_reduce(t: torch.Tensor, tp: Comm) -> torch.Tensor:
    return collectives.all_reduce(t.contiguous().clone(), tp, op="sum")


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Replicated:
    """How the residual stream meets the tensor-parallel layers without ``dist.sp``: every
    tensor-parallel rank holds all of it. The default of every ``sequence`` slot (the strategy the
    model is built with; ``sequence_parallel.SequenceSplit`` is the other): a column layer's input
    is copied into the region (its backward all-reduces), a row layer's partial sums are
    all-reduced, and the stream is neither cut nor gathered."""

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    parts = 1  # the stream is not split along the sequence

    def held(self, positions: torch.Tensor) -> torch.Tensor:
        """The positions of the tokens this rank holds in the stream: all of them."""
        return positions

    def into_column(self, x: torch.Tensor, tp: Comm) -> torch.Tensor:
        return _CopyToTP.apply(x, tp)

    def out_of_row(self, partial: torch.Tensor, tp: Comm) -> torch.Tensor:
        return _ReduceFromTP.apply(partial, tp)

    def replicated_in(self, x: torch.Tensor) -> torch.Tensor:
        """The input of a computation every tensor-parallel rank runs whole inside a region (a
        router): as it is."""
        return x

    def replicated_out(self, x: torch.Tensor) -> torch.Tensor:
        """A region's output that every rank holds whole and complete (an MoE layer's combined
        experts): as it is, the stream being whole too."""
        return x


REPLICATED = Replicated()
Stream = Replicated | SequenceSplit  # how the residual stream meets the layers


def _param(full: torch.Tensor, split: Split | None) -> nn.Parameter:
    return nn.Parameter(shard_of(full.detach(), split))


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local: this rank's output features; input replicated."""

    def __init__(self, full: nn.Linear, tp: Comm, groups: int = 1, sequence: Stream = REPLICATED):
        super().__init__()
        self.tp = tp
        split = Split(dim=0, parts=tp.size, index=tp.rank, groups=groups)
        self.weight = _param(full.weight, split)
        self.bias = _param(full.bias, split) if full.bias is not None else None
        self.splits = {"weight": split} | ({"bias": split} if full.bias is not None else {})
        # dist.sp (a SequenceSplit): the block hands the input gathered along the sequence (one
        # all-gather for q, k and v), whose backward reduce-scatter sums what copy_to_tp would.
        self.sequence = sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.sequence.into_column(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over TP ranks of x_local W_local^T, plus the replicated bias once."""

    def __init__(self, full: nn.Linear, tp: Comm, sequence: Stream = REPLICATED):
        super().__init__()
        self.tp = tp
        split = Split(dim=1, parts=tp.size, index=tp.rank)
        self.weight = _param(full.weight, split)
        self.bias = _param(full.bias, None) if full.bias is not None else None
        self.splits = {"weight": split}
        # dist.sp (a SequenceSplit): the sum is reduce-scattered along the sequence
        self.sequence = sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.sequence.out_of_row(F.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y

    def sequence_sharded_parameters(self) -> list[nn.Parameter]:
        """With dist.sp the bias is added to this rank's tokens only."""
        return [self.bias] if self.bias is not None else []


@dataclass(frozen=True)
class Column:
    """Split the output features; ``groups`` > 1 for fused projections (q|k|v: 3)."""

    groups: int = 1


@dataclass(frozen=True)
class Row:
    """Split the input features; the outputs are summed over the group. ``routed``: the inputs are
    rows of tokens routed to the layer (an expert's), not the residual stream, so the sums are
    all-reduced whatever the stream's strategy (with ``dist.sp`` the MoE layer cuts its combined
    output to the rank's tokens, ``Replicated.replicated_out``)."""

    routed: bool = False


@dataclass(frozen=True)
class Shared:
    """For a ``SharedInput``: an activation every rank computes whole and reads for its own heads
    only (MLA's rotary key), whose gradient is then summed over the group as a column layer's input."""


class SharedInput(nn.Module):
    """Identity on one rank; in a tensor-parallel region (the plan's ``Shared()``), the way into it
    that a column layer's input takes (``into_column``: its backward all-reduces the gradient, or,
    with ``dist.sp``, the block's gather sums it)."""

    splits: dict = {}  # no parameters

    def __init__(self, tp: Comm | None = None, sequence: Stream = REPLICATED):
        super().__init__()
        self.tp, self.sequence = tp, sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else self.sequence.into_column(x, self.tp)


# submodule path pattern (fnmatch, per dotted part) -> style: Column/Row for an nn.Linear, Shared
# for a SharedInput, any value a DeclaresSplit module understands
Plan = Mapping[str, object]


@runtime_checkable
class DeclaresSplit(Protocol):
    """A module that says itself how it splits over the tensor-parallel ranks (a fused layer, a
    layer of experts): ``tp_shard(tp, style)`` gets the plan's style as it is (Column/Row or a
    style of its own) and returns this rank's module -- itself narrowed in place, or a replacement
    -- with ``splits``: {its parameter's name, relative to it: Split}; its forward does its own
    communication on ``tp``. An nn.Linear needs no declaration (Column/Row, below)."""

    def tp_shard(self, tp: Comm, style: object) -> nn.Module: ...


def _matches(path: str, pattern: str) -> bool:
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(parts, pats))


def _planned(module: nn.Module, plan: Plan) -> dict[str, list[str]]:
    """{pattern: the paths of the submodules it matches}; each must match one at least, each
    submodule at most one pattern, and be an nn.Linear or declare its split."""
    found: dict[str, list[str]] = {pattern: [] for pattern in plan}
    for path, sub in module.named_modules():
        matched = [pattern for pattern in plan if _matches(path, pattern)]
        if len(matched) > 1:
            raise ValueError(f"{path} matches several tensor-parallel plan patterns: {matched}")
        if matched and not isinstance(sub, (nn.Linear, DeclaresSplit, SharedInput)):
            raise TypeError(
                f"tensor-parallel plan {matched[0]!r} matches {path}, a {type(sub).__name__}, "
                f"neither an nn.Linear, a SharedInput nor a module that declares its split (tp_shard)"
            )
        for pattern in matched:
            found[pattern].append(path)
    unused = [pattern for pattern, paths in found.items() if not paths]
    if unused:
        raise ValueError(f"tensor-parallel plan patterns match no submodule: {unused}")
    return found


def _shard_linear(full: nn.Linear, tp: Comm, style: object, path: str, sequence: Stream) -> nn.Module:
    column = isinstance(style, Column)
    features, parts = (full.out_features, tp.size * style.groups) if column else (full.in_features, tp.size)
    if features % parts:
        raise ValueError(
            f"{path}: {features} {'output' if column else 'input'} "
            f"features do not split into {parts} equal tensor-parallel parts"
        )
    if column:
        return ColumnParallelLinear(full, tp, style.groups, sequence)
    return RowParallelLinear(full, tp, REPLICATED if style.routed else sequence)


def parallelize_(module: nn.Module, tp: Comm, plan: Plan, sequence: Stream = REPLICATED) -> dict[str, Split]:
    """Replace every submodule of ``module`` whose path matches a pattern of ``plan`` with this
    rank's shard of it (in place: names and order of the parameters are kept): an nn.Linear with
    its column- or row-parallel shard, a ``DeclaresSplit`` module with what its ``tp_shard``
    returns (a declaration wins over being an nn.Linear). Returns {parameter name: Split} of the
    parameters now split. A tensor-parallel group of one changes nothing (the layers stay plain
    ``nn.Linear``: a row-parallel layer adds its bias after the matmul, which rounds differently).
    ``sequence``: how the stream meets the layers (``REPLICATED``, the default, or
    ``sequence_parallel.SequenceSplit``, which a module that declares its own split, doing its own
    communication, does not know: refused)."""
    found = _planned(module, plan)
    if tp.size == 1:
        return {}
    if sequence is not REPLICATED:
        foreign = [
            p for paths in found.values() for p in paths if isinstance(module.get_submodule(p), DeclaresSplit)
        ]
        if foreign:
            raise ValueError(f"sequence parallelism needs column/row-parallel linear layers, not: {foreign}")
    splits = {}
    for pattern, paths in found.items():
        for path in paths:
            parent, _, name = path.rpartition(".")
            owner = module.get_submodule(parent)
            full = owner.get_submodule(name)
            if isinstance(full, DeclaresSplit):
                layer = full.tp_shard(tp, plan[pattern])
            elif isinstance(full, SharedInput):
                layer = SharedInput(tp, sequence)
            else:
                layer = _shard_linear(full, tp, plan[pattern], path, sequence)
            setattr(owner, name, layer)  # replacing an existing child keeps its place: same parameter order
            splits.update({f"{path}.{p}": s for p, s in layer.splits.items()})
    return splits


def full_shape(local: tuple[int, ...], split: Split | None) -> tuple[int, ...]:
    """The unsharded shape of a parameter whose local piece has shape ``local``."""
    if split is None:
        return tuple(local)
    return tuple(n * split.parts if d == split.dim else n for d, n in enumerate(local))


def manifest_layouts(layout_dict: dict, splits: dict[str, Split]) -> list[dict]:
    """One FlatLayout dict per tensor-parallel rank (``layout_dict`` is any rank's; they share
    names, shapes and offsets), each parameter with its ``full_shape`` and this rank's ``split``
    (null if replicated): what a checkpoint manifest needs to reassemble or reshard the pieces."""
    parts = next(iter(splits.values())).parts if splits else 1
    out = []
    for t in range(parts):
        params = []
        for p in layout_dict["params"]:
            split = splits.get(p["name"])
            params.append(
                {
                    **p,
                    "full_shape": list(full_shape(tuple(p["shape"]), split)),
                    "split": Split(split.dim, split.parts, t, split.groups).to_dict() if split else None,
                }
            )
        out.append({**layout_dict, "params": params})
    return out
