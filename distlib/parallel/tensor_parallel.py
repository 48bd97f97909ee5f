"""Megatron-style tensor parallelism for MiniGPT's attention and MLP.

With T tensor-parallel ranks, tensor rank t of a block holds

  attention  the QKV columns of heads [t*H/T, (t+1)*H/T) (their q, k and v rows of
             ``qkv.weight``) and the matching input columns of the output projection;
  MLP        hidden units [t*F/T, (t+1)*F/T): rows of ``fc``, columns of ``proj``.

Each half runs column-parallel then row-parallel: the replicated input enters
through ``copy_to_tp`` (identity forward, all-reduce of the input gradient
backward) and the partial outputs leave through ``reduce_from_tp`` (all-reduce
forward, identity backward), both with the hand-written collectives on the TP
group. The row-parallel bias is replicated and added once, after the sum.

Everything else (embeddings, LayerNorms, LM head) is replicated. Its inputs are
identical bytes on every TP rank (they come out of an all-reduce) and so are its
gradients, so replicated parameters stay bitwise equal across TP ranks without
any extra communication (tests/test_parallel.py checks it).

Parameter names are the unsharded model's; only the shapes shrink. ``Split``
records how a local parameter maps to the full one, which the checkpoint
manifest stores and ``shard_of`` applies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlib.comm import collectives
from distlib.comm.group import Comm
from distlib.app.model import MiniGPT, ModelConfig


class TPLayoutError(ValueError):
    """A model that cannot be split over this many tensor-parallel ranks."""


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
    pieces = [g.chunk(split.parts, dim=split.dim)[split.index] for g in full.chunk(split.groups, dim=split.dim)]
    return torch.cat(pieces, dim=split.dim).contiguous()


@dataclass
class TPGroup:
    """The tensor-parallel group all sharded layers of one model talk over, plus what they sent."""
    comm: Comm
    bytes_sent: int = 0      # nominal 2(T-1)/T * B per all-reduce of B bytes, forward and backward
    splits: dict[str, Split] = field(default_factory=dict)   # parameter name -> its split

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        out = t.contiguous().clone()
        n = self.comm.size
        self.bytes_sent += 2 * (n - 1) * out.numel() * out.element_size() // n
        return collectives.all_reduce(out, self.comm, op="sum")


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return group.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local: this rank's output features; input replicated."""

    def __init__(self, full: nn.Linear, group: TPGroup, groups: int = 1):
        super().__init__()
        self.group = group
        split = Split(dim=0, parts=group.comm.size, index=group.comm.rank, groups=groups)
        self.weight = nn.Parameter(shard_of(full.weight.detach(), split))
        self.bias = nn.Parameter(shard_of(full.bias.detach(), split))
        self.splits = {"weight": split, "bias": split}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over TP ranks of x_local W_local^T, plus the replicated bias once."""

    def __init__(self, full: nn.Linear, group: TPGroup):
        super().__init__()
        self.group = group
        split = Split(dim=1, parts=group.comm.size, index=group.comm.rank)
        self.weight = nn.Parameter(shard_of(full.weight.detach(), split))
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.splits = {"weight": split}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group) + self.bias


class ParallelAttention(nn.Module):
    """Causal self-attention over this rank's H/T heads (same arithmetic per head as model.py)."""

    def __init__(self, full: nn.Module, cfg: ModelConfig, group: TPGroup):
        super().__init__()
        t = group.comm.size
        self.n_heads = cfg.n_heads // t
        self.head_dim = cfg.dim // cfg.n_heads
        self.qkv = ColumnParallelLinear(full.qkv, group, groups=3)
        self.proj = RowParallelLinear(full.proj, group)
        self.dropout = cfg.dropout
        self.register_buffer("causal_mask", full.causal_mask.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        local = self.n_heads * self.head_dim
        q, k, v = self.qkv(x).split(local, dim=2)
        q, k, v = (u.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2) for u in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.causal_mask[:seq, :seq], float("-inf"))
        weights = F.dropout(F.softmax(scores, dim=-1), self.dropout, self.training)
        out = (weights @ v).transpose(1, 2).reshape(batch, seq, local)
        return F.dropout(self.proj(out), self.dropout, self.training)


class ParallelMLP(nn.Module):
    def __init__(self, full: nn.Module, group: TPGroup, dropout: float):
        super().__init__()
        self.fc = ColumnParallelLinear(full.fc, group)
        self.proj = RowParallelLinear(full.proj, group)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


def check_tp_layout(cfg: ModelConfig, tp: int) -> None:
    """Heads must split evenly; then so do dim (a multiple of n_heads) and the MLP width."""
    if cfg.n_heads % tp:
        raise TPLayoutError(f"dist.tp={tp} must divide model.n_heads={cfg.n_heads} (heads are split across "
                            f"tensor-parallel ranks)")


def shard_model_(model: MiniGPT, tp: Comm) -> TPGroup:
    """Replace every block's attention and MLP with this rank's tensor-parallel shard of it
    (in place, keeping parameter names and order). Returns the group with each split."""
    group = TPGroup(tp)
    if tp.size == 1:
        return group
    check_tp_layout(model.cfg, tp.size)
    for i, block in enumerate(model.blocks):
        block.attn = ParallelAttention(block.attn, model.cfg, group)
        block.mlp = ParallelMLP(block.mlp, group, model.cfg.dropout)
        for part in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"):
            layer = block.get_submodule(part)
            for pname, split in layer.splits.items():
                group.splits[f"blocks.{i}.{part}.{pname}"] = split
    return group


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
            params.append({**p, "full_shape": list(full_shape(tuple(p["shape"]), split)),
                           "split": Split(split.dim, split.parts, t, split.groups).to_dict() if split else None})
        out.append({**layout_dict, "params": params})
    return out
