"""Ring attention for multi-head latent attention: the compressed latent travels, not the keys and
values (``travel.Latent``). Each rank expands every visiting block with the up-projection it holds
(under tensor parallelism, its heads' rows), attends as ``ring`` does, and in the backward sends the
latent's and the rotary key's gradients home; the up-projection's gradient is each rank's sum over
the blocks it expanded (the batch ranks' gradient sum adds them up, as for any weight). The
arithmetic of each block is ``ring``'s on the expanded keys and values."""

from __future__ import annotations

import torch
from torch import Tensor

from distlib.comm.group import Comm
from distlib.parallel.context import ring
from distlib.parallel.context.travel import Latent, LatentKV
from distlib.parallel.documents import Documents


class _LatentRing(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, latent, k_rot, weight, dims, comm, positions, scale, softmax_dtype, dropout, stats, docs
    ):
        ar, lay = ring.setup(q, comm, positions, scale, False, softmax_dtype, docs)
        out, lse = ring._forward(
            ar, lay, q, Latent(latent, k_rot, LatentKV(weight, *dims), ar.acc), dropout, stats
        )
        ctx.save_for_backward(q, out, lse, ring.no_tensor(dropout, q), latent, k_rot, weight)
        ctx.ar, ctx.lay, ctx.stats, ctx.dims = ar, lay, stats, dims
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors  # once: under activation checkpointing a second read fails
        q, latent, k_rot, weight = saved[0], *saved[4:]
        trav = Latent(latent, k_rot, LatentKV(weight, *ctx.dims), ctx.ar.acc)
        rung = ring._Backward(ctx.ar, ctx.lay, saved[:4], trav, dout, ctx.stats)
        d_latent, d_rot = trav.owner_grads(rung.run())
        grads = (rung.dq.to(q.dtype), d_latent.to(latent.dtype), d_rot.to(k_rot.dtype))
        return *grads, trav.weight_grad.to(weight.dtype), *(None,) * 8


def latent_ring_attention(
    q: Tensor,
    latent: Tensor,
    k_rot: Tensor,
    up: LatentKV,
    comm: Comm,
    positions: Tensor,
    *,
    scale: float,
    softmax_dtype: torch.dtype | None = None,
    dropout: Tensor | None = None,
    stats: ring.RingStats | None = None,
    documents: Documents | None = None,
) -> Tensor:
    """``ring.ring_attention`` of q (batch, heads, local tokens, nope + rope) against the keys and
    values ``up`` expands from ``latent`` (batch, local tokens, rank) and ``k_rot`` (batch, 1, local
    tokens, rope); differentiable in q, latent, k_rot and ``up.weight``. ``documents``: as the ring's."""
    dims = (up.nope, up.v_dim)
    return _LatentRing.apply(
        q, latent, k_rot, up.weight, dims, comm, positions, scale, softmax_dtype, dropout, stats, documents
    )
