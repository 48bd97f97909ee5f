"""Grouped-query attention's key/value heads: kv head j serves the n_rep consecutive query heads
j*n_rep .. (j+1)*n_rep-1 (transformers' ``repeat_kv``). They are repeated to the query heads only
where attention is computed: what travels between context-parallel ranks is the grouped heads,
n_rep times fewer bytes than the repeated ones (benchmarks/context.py measures it)."""

from __future__ import annotations

import torch


def repeats(q: torch.Tensor, kv: torch.Tensor) -> int:
    """How many query heads each key/value head serves: (batch, heads, seq, d) shapes."""
    heads, groups = q.shape[1], kv.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} query heads do not group over {groups} key/value heads")
    return heads // groups


def repeat_kv(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv heads, seq, d) -> (batch, kv heads * n_rep, seq, d), each head repeated in place."""
    if n_rep == 1:
        return t
    batch, kv, seq, d = t.shape
    return t[:, :, None].expand(batch, kv, n_rep, seq, d).reshape(batch, kv * n_rep, seq, d)


def fold_kv(g: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of ``repeat_kv``: (batch, kv heads * n_rep, seq, d) -> (batch, kv heads, seq, d),
    each group of n_rep heads summed."""
    if n_rep == 1:
        return g
    batch, heads, seq, d = g.shape
    return g.reshape(batch, heads // n_rep, n_rep, seq, d).sum(2)
