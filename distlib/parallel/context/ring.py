"""Ring attention: exact causal attention for a sequence split over a context-parallel group.

Every rank keeps its queries; the keys and values travel around the group (rank r sends to r + 1
and receives from r - 1), so at ring step s rank r holds the block of rank (r - s) mod N. Each
step attends the local queries to the visiting block and merges the partial result into a
running one by log-sum-exp, in ring order: the same order every run, whatever the arrival
timing, so the output is deterministic. Blocks are split into the ``chunks`` layout's chunks and
a (query chunk, key chunk) pair entirely in the query's future is never computed; with the
zig-zag layout every rank computes 2N + 1 such pairs (``block_count``; which pairs, and their
rows and masks: ``ring_blocks``). With packed documents (``distlib.parallel.documents``) a pair
that no query of the chunk reaches is not computed either, and a row that sees no key of a
computed block adds an empty partial to the merge (output 0, log-sum-exp -inf); the ranks then hold
the chunks ``balance`` pairs for the documents, which evens out what is left.

The backward runs the same ring: the keys and values travel again, each rank computes dq for
its queries and its contribution to the visiting block's dk/dv, and the contributions travel
with it, summed in ring order starting at the owner, until they arrive back home. What travels is
a ``travel`` object's: the keys and values themselves (``KeysValues``), or for latent attention the
latent they are expanded from and its gradients (``Latent``, ``latent_ring``).

Dropout on the attention weights comes in as factors (0 or 1 / (1 - p)) for this rank's query rows
against every key position of the sequence; a block takes its columns. A block's weights are its
share of the whole softmax, so the dropped numerator and the undropped normaliser merge as
before, and the backward needs only two more products: dp through the factors, and dv from the
dropped weights (delta = rowsum(dout * out) is still the softmax backward's rowsum(p * dp)).

The arithmetic mirrors ``causal_attention``'s explicit path: scores in the inputs' dtype,
``* scale`` (or ``/ scale`` with ``divide``), the softmax statistics in ``softmax_dtype``
(at least float32: the log-sum-exp merge of bf16 partials needs it), weights cast back to v's
dtype before ``@ v``. The backward works in that float dtype (its dp and delta in float64:
``_block_grads`` says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from distlib.comm.group import Comm
from distlib.comm.p2p import P2P
from distlib.parallel import grouped_heads
from distlib.parallel.context.ring_blocks import Layout, RingStats, block_count, step_blocks
from distlib.parallel.context.travel import KeysValues, Latent
from distlib.parallel.documents import Documents

__all__ = ["RingStats", "block_count", "ring_attention", "setup", "step_blocks"]

Traveller = KeysValues | Latent  # what travels around the ring (``travel``)


@dataclass(frozen=True)
class Arith:
    """The arithmetic options, as ``causal_attention`` takes them; ``acc``: the softmax's dtype."""

    scale: float
    divide: bool
    acc: torch.dtype

    def scores(self, q: Tensor, k: Tensor, mask: Tensor | None) -> Tensor:
        s = q @ k.transpose(-2, -1)
        s = (s / self.scale if self.divide else s * self.scale).to(self.acc)
        return s if mask is None else s.masked_fill(~mask, float("-inf"))

    def unscale(self, g: Tensor) -> Tensor:
        """The gradient through ``scores``' scaling."""
        return g / self.scale if self.divide else g * self.scale


def _partial(ar: Arith, q: Tensor, k: Tensor, v: Tensor, mask, drop, empty: bool) -> tuple[Tensor, Tensor]:
    """One block's attention, normalised within the block, and its rows' log-sum-exp (k and v
    travel with their grouped-query heads: repeated to q's here); ``drop``: the block's dropout
    factors, applied to the weights after the normalisation (None: none). ``empty``: a row may see
    no key of the block (documents): its output is 0 and its log-sum-exp -inf."""
    n_rep = grouped_heads.repeats(q, k)
    k, v = grouped_heads.repeat_kv(k, n_rep), grouped_heads.repeat_kv(v, n_rep)
    s = ar.scores(q, k, mask)
    m = s.amax(-1, keepdim=True)  # causal alone: every row sees its diagonal or a whole earlier chunk
    if empty:
        m = finite(m)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    weights = (e / (total.clamp_min(torch.finfo(total.dtype).tiny) if empty else total)).to(v.dtype)
    out = (weights if drop is None else weights * drop) @ v
    return out.to(ar.acc), m + total.log()


def finite(t: Tensor) -> Tensor:
    """``t`` with -inf (a row that saw no key yet) as 0, to subtract without making NaN."""
    return torch.where(torch.isneginf(t), torch.zeros_like(t), t)


def _merge(state: tuple[Tensor, Tensor] | None, out: Tensor, lse: Tensor, empty: bool) -> tuple:
    """Running (output, log-sum-exp) with one more block's: weighted by each side's share
    (``empty``: as ``_partial``'s; two empty sides stay empty)."""
    if state is None:
        return out, lse
    run, run_lse = state
    new = torch.logaddexp(run_lse, lse)
    ref = finite(new) if empty else new
    return run * torch.exp(run_lse - ref) + out * torch.exp(lse - ref), new


def _forward(ar: Arith, lay: Layout, q: Tensor, trav: Traveller, dropout, stats: RingStats | None):
    p2p, n, me = P2P("ring_attention", lay.comm), lay.n, lay.me
    cur = trav.message()  # one message a step; sent from and received into two buffers
    spare = torch.empty_like(cur)
    states: list = [None, None]
    for s in range(n):
        src = (me - s) % n
        # the next block travels while this one is attended
        handles = (p2p.send(cur, me + 1), p2p.recv(spare, me - 1)) if s < n - 1 else ()
        k, v = trav.kv(cur)
        for blk in lay.blocks(src):
            a, b0, b1, _ = blk
            keys, qrows = lay.rows(b0, b1), lay.rows(a, a + 1)
            kv = k[..., keys, :], v[..., keys, :]
            mask, drop = lay.mask(blk, src), lay.factors(dropout, blk, src)
            part = _partial(ar, q[..., qrows, :], *kv, mask, drop, lay.empty_rows)
            states[a] = _merge(states[a], *part, lay.empty_rows)
            if stats is not None:
                stats.forward_blocks += b1 - b0
        p2p.wait(*handles)
        cur, spare = spare, cur
    out = torch.cat([states[0][0], states[1][0]], dim=-2)
    return out.to(v.dtype), torch.cat([states[0][1], states[1][1]], dim=-2)


def _block_grads(ar: Arith, q, k, v, dout, lse, delta, mask, drop):
    """dq, dk, dv of one block, from the final log-sum-exp: p is the block's share of the whole
    softmax, and delta = rowsum(dout * out) is the softmax backward's rowsum(p * dp).

    dp - delta cancels (for a query with one key, to exactly 0), and delta cannot be summed from
    the rounded dp of every block in one ring pass, as autograd's softmax backward does; so dp
    and delta are float64, where their rounding is below float32's (measured, in float32: dq
    4x autograd's error, 1.2e-6 where the true value is 0). dk and dv are folded back to k's and v's
    grouped-query heads before they travel. ``drop``: the block's dropout factors (None: none)."""
    n_rep = grouped_heads.repeats(q, k)
    k, v = grouped_heads.repeat_kv(k, n_rep), grouped_heads.repeat_kv(v, n_rep)
    p = torch.exp(ar.scores(q, k, mask) - lse)
    q, k, v = q.to(ar.acc), k.to(ar.acc), v.to(ar.acc)
    dp = dout.double() @ v.double().transpose(-2, -1)
    kept = p
    if drop is not None:
        dp, kept = dp * drop.double(), p * drop.to(ar.acc)
    ds = ar.unscale((p.double() * (dp - delta)).to(ar.acc))
    dk, dv = ds.transpose(-2, -1) @ q, kept.transpose(-2, -1) @ dout
    return ds @ k, grouped_heads.fold_kv(dk, n_rep), grouped_heads.fold_kv(dv, n_rep)


class _Backward:
    """The backward ring's state on one rank: dq for its queries, the visiting block's dk/dv."""

    def __init__(self, ar: Arith, lay: Layout, saved, trav: Traveller, dout: Tensor, stats: RingStats | None):
        q, out, lse, dropout = saved
        self.ar, self.lay, self.q, self.lse, self.stats, self.trav = ar, lay, q, lse, stats, trav
        self.dropout = dropout if dropout.numel() else None
        self.dout = dout.to(ar.acc)
        self.delta = (self.dout.double() * out.double()).sum(-1, keepdim=True)  # _block_grads: why float64
        self.dq = torch.zeros(q.shape, dtype=ar.acc, device=q.device)

    def contribution(self, packed: Tensor, src: int) -> Tensor:
        """This rank's part of the gradient message for ``src``'s block (``packed``: its message);
        dq accumulates in ring order."""
        lay, kv = self.lay, self.trav.kv(packed)
        mine = [torch.zeros(t.shape, dtype=self.ar.acc, device=t.device) for t in kv]
        for blk in lay.blocks(src):
            a, b0, b1, _ = blk
            keys, qrows = lay.rows(b0, b1), lay.rows(a, a + 1)
            dq, dk, dv = _block_grads(
                self.ar,
                self.q[..., qrows, :],
                kv[0][..., keys, :],
                kv[1][..., keys, :],
                self.dout[..., qrows, :],
                self.lse[..., qrows, :],
                self.delta[..., qrows, :],
                lay.mask(blk, src),
                lay.factors(self.dropout, blk, src),
            )
            self.dq[..., qrows, :] += dq
            mine[0][..., keys, :] += dk
            mine[1][..., keys, :] += dv
            if self.stats is not None:
                self.stats.backward_blocks += b1 - b0
        return self.trav.grad_message(*mine, packed)

    def run(self) -> Tensor:
        """The ring; returns this rank's own gradient message, summed over the ring. Per step a
        rank sends the block, then the block's summed gradient message, and receives in the same
        order, so every message pairs with its own on the other side."""
        lay, n, me = self.lay, self.lay.n, self.lay.me
        if n == 1:  # no ring: the one contribution is our own
            return self.contribution(self.trav.message(), me)
        p2p = P2P("ring_attention_backward", lay.comm)
        cur = self.trav.message()
        spare = torch.empty_like(cur)
        incoming = sending = None  # (buffer, handle): the visiting block's dk/dv so far; ours out
        for s in range(n):
            src = (me - s) % n
            handles = (p2p.send(cur, me + 1), p2p.recv(spare, me - 1)) if s < n - 1 else ()
            total = self.contribution(cur, src)
            if incoming is not None:  # the owner's and the ranks' after it, then ours
                p2p.wait(incoming[1])
                total = incoming[0] + total
            if sending is not None:
                p2p.wait(sending[1])
            sending = (total, p2p.send(total, me + 1))
            # after the last step, what arrives is our own block's, summed over the whole ring
            buf = torch.empty(self.trav.grad_numel, dtype=self.ar.acc, device=cur.device)
            incoming = (buf, p2p.recv(buf, me - 1))
            p2p.wait(*handles)
            cur, spare = spare, cur
        p2p.wait(incoming[1], sending[1])
        return incoming[0]


def setup(
    q: Tensor, comm: Comm, positions: Tensor, scale: float, divide: bool, softmax_dtype, documents
) -> tuple:
    """(Arith, Layout) of one ring attention call."""
    acc = torch.promote_types(softmax_dtype or q.dtype, torch.float32)
    return Arith(scale, divide, acc), Layout(comm, positions, q.shape[-2], documents)


def no_tensor(t: Tensor | None, like: Tensor) -> Tensor:
    """``t``, or an empty tensor for None (save_for_backward takes tensors only)."""
    return torch.empty(0, device=like.device) if t is None else t


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, positions, scale, divide, softmax_dtype, dropout, stats, documents):
        ar, lay = setup(q, comm, positions, scale, divide, softmax_dtype, documents)
        out, lse = _forward(ar, lay, q, KeysValues(k, v), dropout, stats)
        ctx.save_for_backward(q, out, lse, no_tensor(dropout, q), k, v)
        ctx.ar, ctx.lay, ctx.stats = ar, lay, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors  # once: under activation checkpointing a second read fails
        q, k, v = saved[0], saved[4], saved[5]
        ring = _Backward(ctx.ar, ctx.lay, saved[:4], KeysValues(k, v), dout, ctx.stats)
        dk, dv = ring.trav.owner_grads(ring.run())
        return ring.dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *(None,) * 8


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    comm: Comm,
    positions: Tensor,
    *,
    scale: float,
    divide: bool = False,
    softmax_dtype: torch.dtype | None = None,
    dropout: Tensor | None = None,
    stats: RingStats | None = None,
    documents: Documents | None = None,
) -> Tensor:
    """This rank's rows of causal attention over the whole sequence, split over ``comm`` in the
    ``chunks`` layout. q, k, v: (batch, heads, local tokens, head_dim), this rank's tokens in the
    order it holds them, k and v with their own grouped-query heads (they travel so, and are repeated
    to q's where a block is attended); ``positions``: their positions in
    the sequence (``chunks.positions``; they give the causal mask). Returns (batch, heads, local
    tokens, head_dim), heads not merged. ``scale``, ``divide``, ``softmax_dtype``: as
    ``causal_attention``. ``dropout``: the attention weights' dropout factors for this rank's query
    rows against every key position, (batch, heads, local tokens, seq_len) (None: no dropout).
    ``stats`` (if given) counts the pairs attended. ``documents``: attention stays inside each
    document of the sequences (``distlib.parallel.documents``; None: causal only). Differentiable; the
    backward is a ring too, so every rank must call backward as well."""
    return _RingAttention.apply(
        q, k, v, comm, positions, scale, divide, softmax_dtype, dropout, stats, documents
    )
