"""The one causal attention every family calls, after its projections (and Llama's rotary).

Two paths. The explicit one (scores, masked_fill, softmax, dropout, weights @ v) is what every
family runs: each tensor-parallel layout and each device then does the same arithmetic, and for
GPT-2 and Llama it is transformers' "eager" attention. What the families differ in is an
argument, not a copy of the code: MiniGPT divides the scores by sqrt(head_dim) where transformers
multiplies by its inverse (the two round differently), and Llama takes the softmax in float32.
The other path is torch's fused ``scaled_dot_product_attention`` (``sdpa=True``): the same function
within rounding (tests/test_model_seams.py), which no family selects yet -- it changes the bits.

DeepSeek-V3's latent attention calls ``latent_causal_attention``: the same attention, its keys and
values handed over as the latent they are expanded from, so that the context strategy expands them
where it attends (the ring after the latent travelled: ``parallel.context.latent_ring``; the
all-to-all after the latent was gathered: ``ulysses_latent_attention``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from distlib.comm.group import Comm
from distlib.parallel import grouped_heads
from distlib.parallel.context import balance, chunks
from distlib.parallel.context.latent_ring import latent_ring_attention
from distlib.parallel.context.ring import ring_attention
from distlib.parallel.context.travel import LatentKV
from distlib.parallel.context.ulysses import gathering_sends_less, ulysses_attention, ulysses_latent_attention
from distlib.parallel.documents import Documents
from distlib.parallel.dropout import Draws


@functools.lru_cache(maxsize=8)
def causal_mask(seq_len: int) -> torch.Tensor:
    """True where a query may attend (key position <= query position). Made on the CPU whatever the
    default device, so every device starts from the same buffer; it moves with the model. One
    tensor serves every block (read, never written): a model of 32 blocks at 4,096 tokens held
    32 of 16 MB, and took 0.2 s to make them."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device="cpu").tril()


def split_heads(t: torch.Tensor, head_size: int) -> torch.Tensor:
    """(batch, seq, local heads * head_size) -> (batch, local heads, seq, head_size). The head count
    comes from the width, so a column-parallel shard (fewer heads) runs the same code."""
    batch, seq, _ = t.shape
    return t.view(batch, seq, -1, head_size).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_size) -> (batch, seq, heads * head_size), as transformers' reshape."""
    batch, _, seq, _ = t.shape
    return t.transpose(1, 2).reshape(batch, seq, -1).contiguous()


@dataclass(frozen=True)
class WeightsDropout:
    """Dropout on the attention weights: ``p`` (0 outside training), the micro-batch's ``draws``
    (None: torch's RNG, ``F.dropout``), and ``seq_len`` (the model's; the masks are drawn over
    (all heads, seq_len, seq_len) per sample and kept where this rank's weights are)."""

    p: float
    draws: Draws | None
    seq_len: int

    def __call__(self, weights: torch.Tensor, share: tuple[int, int] = (0, 1)) -> torch.Tensor:
        """``weights`` (batch, heads, seq, seq) of whole sequences; ``share``: which (index, count)
        share of this rank's tensor-parallel heads they are (DeepSpeed-Ulysses)."""
        if self.p == 0:
            return weights
        if self.draws is None:
            return F.dropout(weights, self.p, True)
        seq = slice(0, weights.shape[-1])
        index = (self._heads(weights, share), seq, seq)
        return self.draws.apply(weights, self.p, "attn.weights", self._full(weights, share), index)

    def rows(self, like: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The factors for this rank's query rows at ``positions`` against every key position,
        (batch, heads, len(positions), seq_len) (the ring's: it attends blocks of keys); None at p = 0."""
        if self.p == 0:
            return None
        b, h = like.shape[:2]
        if self.draws is None:
            ones = torch.ones(b, h, positions.shape[0], self.seq_len, dtype=like.dtype, device=like.device)
            return F.dropout(ones, self.p, True)
        index = (self._heads(like, (0, 1)), positions, None)
        return self.draws.noise("attn.weights", self.p, self._full(like, (0, 1)), index, like)

    def _full(self, like: torch.Tensor, share: tuple[int, int]) -> tuple[int, int, int]:
        heads = like.shape[1] * share[1] * self.draws.share[1]
        return (heads, self.seq_len, self.seq_len)

    def _heads(self, like: torch.Tensor, share: tuple[int, int]) -> torch.Tensor:
        return self.draws.head_ids(like.shape[1], like.device, share)


class WholeSequence:
    """Attention without context parallelism: every rank holds whole sequences, so ``whole`` (the
    one-rank attention) is all there is. The default of every attention module's ``context`` (the
    strategy the model is built with); ``ContextSplit`` is the other."""

    def attend(self, q, k, v, whole: Callable, **kept) -> torch.Tensor:
        return whole(q, k, v)

    def attend_latent(self, q, latent, k_rot, up: LatentKV, whole: Callable, **kept) -> torch.Tensor:
        return whole(q, *up.expand(latent, k_rot))


WHOLE = WholeSequence()


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    divide: bool = False,
    softmax_dtype: torch.dtype | None = None,
    dropout: float = 0.0,
    training: bool = False,
    sdpa: bool = False,
    context: Context = WHOLE,
    draws: Draws | None = None,
    documents: Documents | None = None,
) -> torch.Tensor:
    """softmax(q @ k^T * scale, causal) @ v with heads merged: q, k, v (batch, heads, seq, head_dim),
    k and v with their own heads (grouped-query: each serves q.heads/k.heads query heads,
    ``grouped_heads``); the result (batch, seq, heads * head_dim). ``divide``:
    scores / scale instead. ``softmax_dtype``: the softmax's dtype, cast back to v's. ``dropout`` on
    the attention weights while ``training``, with the masks of ``draws`` (``WeightsDropout``).
    ``mask`` is ``causal_mask`` (the explicit path reads its top-left seq x seq corner; its size is
    the model's seq_len). ``context``: ``WHOLE``, or the sequence split over a context-parallel
    group (``ContextSplit``): q, k, v are this rank's tokens and so is the result. ``documents``: the
    sequences are packed documents, each attending only itself (``distlib.parallel.documents``)."""
    drop = WeightsDropout(dropout if training else 0.0, draws, mask.shape[0])
    whole, kept = _arithmetic(mask, scale, divide, softmax_dtype, drop, sdpa, documents)
    return merge_heads(context.attend(q, k, v, whole, **kept))


def latent_causal_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    up: LatentKV,
    mask: torch.Tensor,
    *,
    scale: float,
    softmax_dtype: torch.dtype | None = None,
    dropout: float = 0.0,
    training: bool = False,
    context: Context = WHOLE,
    draws: Draws | None = None,
    documents: Documents | None = None,
) -> torch.Tensor:
    """``causal_attention`` with the keys and values given as the latent (batch, tokens, rank) and
    shared rotary key (batch, 1, tokens, rope) ``up`` expands them from (multi-head latent
    attention): the context expands them where it attends (the ring: after the latent travelled)."""
    drop = WeightsDropout(dropout if training else 0.0, draws, mask.shape[0])
    whole, kept = _arithmetic(mask, scale, False, softmax_dtype, drop, False, documents)
    return merge_heads(context.attend_latent(q, latent, k_rot, up, whole, **kept))


def _arithmetic(mask, scale, divide, softmax_dtype, drop, sdpa, documents) -> tuple[Callable, dict]:
    """(one-rank attention of whole sequences, the arguments a context split keeps); with
    ``documents`` the whole sequences' mask is theirs (batch, 1, seq, seq), not the causal one."""
    kwargs = dict(scale=scale, divide=divide, softmax_dtype=softmax_dtype, drop=drop, sdpa=sdpa)
    if documents is not None:
        mask = documents.whole_mask()
    whole = lambda *qkv, share=(0, 1): attend_heads(*qkv, mask, **kwargs, share=share)  # noqa: E731
    kept = dict(scale=scale, divide=divide, softmax_dtype=softmax_dtype, drop=drop, documents=documents)
    return whole, kept


def attend_heads(q, k, v, mask, *, scale, divide, softmax_dtype, drop, sdpa, share) -> torch.Tensor:
    """``causal_attention`` of whole sequences, heads not merged: (batch, heads, seq, head_dim); k and
    v are repeated to q's heads here; ``drop`` and ``share``: as ``WeightsDropout``'s."""
    n_rep = grouped_heads.repeats(q, k)
    k, v = grouped_heads.repeat_kv(k, n_rep), grouped_heads.repeat_kv(v, n_rep)
    if sdpa:
        if drop.p and drop.draws is not None:
            raise ValueError("sdpa draws its own dropout masks; the explicit path keys them (sdpa=False)")
        causal = mask.dim() == 2  # else documents' (batch, 1, seq, seq) mask
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if causal else mask,
            dropout_p=drop.p,
            is_causal=causal,
            scale=1.0 / scale if divide else scale,
        )
    seq = q.shape[-2]
    scores = q @ k.transpose(-2, -1)
    scores = scores / scale if divide else scores * scale
    # transformers adds the dtype's minimum instead of writing -inf; after the softmax both give
    # exactly 0 there (exp underflows), and a causal row always keeps its diagonal.
    scores = scores.masked_fill(~mask[..., :seq, :seq], float("-inf"))
    weights = F.softmax(scores, dim=-1, dtype=softmax_dtype).to(v.dtype)
    return drop(weights, share) @ v


@dataclass(frozen=True)
class ContextSplit:
    """This rank's share of a sequence split over a context-parallel group (``dist.cp``): which
    tokens it holds (``distlib.parallel.context.chunks``) and how attention reaches the others'
    (``impl``: alltoall or ring). Each attention module gets it when built (``strategies``)."""

    comm: Comm
    impl: str

    def positions(self, seq_len: int, device, documents: Documents | None = None) -> torch.Tensor:
        """The sequence positions of this rank's tokens: its chunks, balanced for ``documents``
        (``distlib.parallel.context.balance``)."""
        owned = balance.owned(documents, self.comm.size)
        return chunks.positions(seq_len, self.comm.size, self.comm.rank, device, owned)

    def attend(
        self, q, k, v, whole: Callable, *, scale, divide, softmax_dtype, drop, documents
    ) -> torch.Tensor:
        """This rank's rows of attention, unmerged; ``whole``: one-rank attention of whole sequences
        (alltoall); the ring computes its blocks itself, with the same arguments, and drops its
        rows' weights with the factors ``drop`` gives for them."""
        if self.impl == "alltoall":
            return ulysses_attention(q, k, v, self.comm, whole, balance.owned(documents, self.comm.size))
        where = self.positions(q.shape[2] * self.comm.size, q.device, documents)
        return ring_attention(
            q,
            k,
            v,
            self.comm,
            where,
            scale=scale,
            divide=divide,
            softmax_dtype=softmax_dtype,
            dropout=drop.rows(q, where),
            documents=documents,
        )

    def attend_latent(self, q, latent, k_rot, up: LatentKV, whole: Callable, **kept) -> torch.Tensor:
        """As ``attend``, the keys and values from a latent: the all-to-all gathers the latent and
        expands it for this rank's heads (``ulysses_latent_attention``), or expands first where that
        moves fewer bytes (``gathering_sends_less``); the ring sends the latent and expands each
        visiting block (``latent_ring``)."""
        if self.impl == "alltoall":
            width = latent.shape[-1] + k_rot.shape[-1]
            if gathering_sends_less(q.shape[1], q.shape[-1], up.v_dim, width, self.comm.size):
                owned = balance.owned(kept["documents"], self.comm.size)
                return ulysses_latent_attention(q, latent, k_rot, up, self.comm, whole, owned)
            return self.attend(q, *up.expand(latent, k_rot), whole, **kept)
        where = self.positions(q.shape[2] * self.comm.size, q.device, kept["documents"])
        drop = kept["drop"]
        return latent_ring_attention(
            q,
            latent,
            k_rot,
            up,
            self.comm,
            where,
            scale=kept["scale"],
            softmax_dtype=kept["softmax_dtype"],
            dropout=drop.rows(q, where),
            documents=kept["documents"],
        )


Context = WholeSequence | ContextSplit  # how attention reaches the sequence's other tokens
