"""Attention over a context-parallel group by all-to-all (DeepSpeed-Ulysses): sequence shards in,
head shards through attention, sequence shards out.

Before attention each rank holds every head of its own tokens; one all-to-all gives it 1/N of the
heads for every token of the sequence, which ``chunks.gathered``'s order puts back in sequence order.
The attention itself is then the one-rank function, on whole sequences and fewer heads: the same
arithmetic per head as a single rank's. The output goes back by the inverse all-to-all. Autograd:
each all-to-all's backward is the other one.

Multi-head latent attention (``ulysses_latent_attention``) has no key/value heads to move: every
head's keys and values are expanded from one latent per token and a rotary key every head shares.
So the latent and the rotary key are gathered over the group instead (all of the sequence's, in
rank order: sequence parallelism's ``GatherTokens``), and each rank expands them for its share of
the heads only (``LatentKV.heads``); the gather's backward sums the ranks' latent gradients (each
from its own heads) and keeps each rank's tokens. A rank sends (cp - 1) x tokens x (rank + rope)
where the expanded keys and values were (cp - 1) / cp x tokens x heads x (nope + rope + v):
DeepSeek-V3's (512 + 64 against 128 x 320) 71 / cp x fewer. Where the latent is the wider (few
heads, many ranks: ``gathering_sends_less``) the keys and values are expanded first and moved as
any attention's (benchmarks/context.py gives the bytes of each route).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from distlib.comm import collectives
from distlib.comm.group import Comm
from distlib.parallel import grouped_heads
from distlib.parallel.collective_op import collective_function
from distlib.parallel.context import chunks
from distlib.parallel.context.travel import LatentKV
from distlib.parallel.sequence_parallel import GatherTokens


def _heads_for_every_rank(x: torch.Tensor, n: int) -> torch.Tensor:
    """(batch, heads, T, d) -> (n, batch, heads/n, T, d): rank j's heads first along dim 0."""
    b, h, t, d = x.shape
    return x.reshape(b, n, h // n, t, d).transpose(0, 1).contiguous()


def seq_to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(batch, heads, T_local, d) of this rank's tokens -> (batch, heads/N, N x T_local, d): this
    rank's heads for every rank's tokens, the ranks' tokens concatenated in rank order."""
    n = comm.size
    got = collectives.all_to_all(_heads_for_every_rank(x, n), comm, [1] * n, [1] * n)
    _, b, hl, t, d = got.shape
    return got.permute(1, 2, 0, 3, 4).reshape(b, hl, n * t, d)


def heads_to_seq(y: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: (batch, heads/N, N x T_local, d) -> (batch, heads, T_local, d)."""
    n = comm.size
    b, hl, nt, d = y.shape
    pieces = y.reshape(b, hl, n, nt // n, d).permute(2, 0, 1, 3, 4).contiguous()  # rank j's tokens first
    got = collectives.all_to_all(pieces, comm, [1] * n, [1] * n)  # (n, b, hl, T_local, d): rank i's heads
    return got.transpose(0, 1).reshape(b, n * hl, nt // n, d)


_SeqToHeads = collective_function(
    "_SeqToHeads", seq_to_heads, lambda g, comm: heads_to_seq(g.contiguous(), comm)
)
_HeadsToSeq = collective_function(
    "_HeadsToSeq", heads_to_seq, lambda g, comm: seq_to_heads(g.contiguous(), comm)
)


def _split_heads(q: torch.Tensor, n: int) -> int:
    """How many of q's heads each of ``n`` ranks attends."""
    if q.shape[1] % n:
        raise ValueError(f"{q.shape[1]} heads do not split over {n} context-parallel ranks")
    return q.shape[1] // n


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Comm,
    attend: Callable[..., torch.Tensor],
    owned: chunks.Owned | None = None,
) -> torch.Tensor:
    """This rank's rows of causal attention over the whole sequence: q, k, v (batch, heads, T_local,
    head_dim) of its tokens, k and v with their own (grouped-query) heads, q's divisible by N;
    ``attend`` the one-rank attention of whole sequences in order, (batch, h, T, d) for q and k/v with
    h's share of the key/value heads -> (batch, h, T, d), also given which share of the heads they
    are (``share``: (this rank, N): rank j holds the j-th N-th of them, in order; dropout keys its
    masks by head); ``owned``: which chunks each rank holds (``chunks``; None: the zig-zag). Returns
    (batch, heads, T_local, head_dim).
    Key/value heads that divide over N travel as they are (rank j's query heads use exactly the
    key/value heads j receives); otherwise they are repeated first, only to lcm(kv heads, N), which
    divides the query heads: the fewest that split over the ranks."""
    n, t_local = comm.size, q.shape[2]
    _split_heads(q, n)
    grouped_heads.repeats(q, k)  # q's heads a multiple of k's
    n_rep = math.lcm(k.shape[1], n) // k.shape[1]
    k, v = grouped_heads.repeat_kv(k, n_rep), grouped_heads.repeat_kv(v, n_rep)
    seq = n * t_local
    held, order = chunks.gathered(seq, n, q.device, owned)  # sequence -> gathered, and back
    full = [_SeqToHeads.apply(t.contiguous(), comm)[:, :, order] for t in (q, k, v)]
    out = attend(*full, share=(comm.rank, n))
    return _HeadsToSeq.apply(out[:, :, held].contiguous(), comm)


def gathering_sends_less(heads: int, key_width: int, v_width: int, latent_width: int, n: int) -> bool:
    """Whether gathering a latent of ``latent_width`` (rank + rope) a token over ``n`` ranks sends
    fewer bytes than the all-to-all of the ``heads`` keys (``key_width``) and values (``v_width``)
    expanded from it: (n - 1) x latent_width against (n - 1) / n x heads x (key + v) a token."""
    return n * latent_width < heads * (key_width + v_width)


def ulysses_latent_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    up: LatentKV,
    comm: Comm,
    attend: Callable[..., torch.Tensor],
    owned: chunks.Owned | None = None,
) -> torch.Tensor:
    """``ulysses_attention`` with the keys and values given as the latent (batch, T_local, rank) and
    the shared rotary key (batch, 1, T_local, rope) of this rank's tokens: gathered over ``comm``
    and expanded by ``up`` for this rank's share of q's heads only. Returns (batch, heads, T_local,
    v_dim)."""
    n, t_local = comm.size, q.shape[2]
    heads = _split_heads(q, n)
    seq = n * t_local
    held, order = chunks.gathered(seq, n, q.device, owned)
    q_full = _SeqToHeads.apply(q.contiguous(), comm)[:, :, order]
    latent_full = GatherTokens.apply(latent.contiguous(), comm)[:, order]
    rot_full = GatherTokens.apply(k_rot[:, 0].contiguous(), comm)[:, order].unsqueeze(1)
    k, v = up.heads(comm.rank * heads, heads).expand(latent_full, rot_full)
    out = attend(q_full, k, v, share=(comm.rank, n))
    return _HeadsToSeq.apply(out[:, :, held].contiguous(), comm)
