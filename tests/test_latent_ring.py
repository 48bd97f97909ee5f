"""Context parallelism moving DeepSeek-V3's latent, not the keys and values expanded from it, against
one process's attention of the expanded keys and values, on 2 and 4 gloo ranks: the ring with the
latent travelling (distlib/parallel/context/latent_ring.py, dist.cp_impl=ring) and the all-to-all
with the latent gathered (ulysses.ulysses_latent_attention, dist.cp_impl=alltoall). Each: the
output and the gradients of the queries, the latent, the shared rotary key (each rank's rows) and
the up-projection (summed over the ranks); with the keyed dropout masks too. And the bytes, against
the same route moving the expanded keys and values: the ring's messages are (rank + rope) / (heads
x (nope + rope + v)) of them, exactly; the all-to-all gathers (cp - 1) x tokens x (rank + rope)
forward and scatters as much backward, where the keys' and values' all-to-alls moved (cp - 1) / cp
x tokens x heads x (nope + rope + v) each way."""

import numpy as np
import pytest
import torch
from multiproc import run_ranks

from distlib.app.model.attention import (
    ContextSplit,
    WeightsDropout,
    causal_attention,
    causal_mask,
    latent_causal_attention,
)
from distlib.comm.group import Comm
from distlib.parallel.context import chunks
from distlib.parallel.context.latent_ring import latent_ring_attention
from distlib.parallel.context.ring import ring_attention
from distlib.parallel.context.travel import LatentKV
from distlib.parallel.context.ulysses import gathering_sends_less, ulysses_attention
from distlib.parallel.dropout import Draws

SEQ, BATCH, HEADS, NOPE, ROPE, V, RANK = 16, 2, 3, 6, 4, 5, 7
SPLIT_HEADS = 4  # the all-to-all splits the heads over the ranks (the ring takes 3)
SCALE = (NOPE + ROPE) ** -0.5
OPTS = {"plain": (0.0, None), "dropout": (0.3, Draws(3, (11, 12)))}


def _whole(heads: int = HEADS, rank: int = RANK) -> list[torch.Tensor]:
    """q, latent, the rotary key, the up-projection and the upstream gradient of the whole sequence."""
    gen = torch.Generator().manual_seed(77)
    shapes = [
        (BATCH, heads, SEQ, NOPE + ROPE),
        (BATCH, SEQ, rank),
        (BATCH, 1, SEQ, ROPE),
        (heads * (NOPE + V), rank),
        (BATCH, heads, SEQ, V),
    ]
    q, latent, k_rot, weight, dout = (torch.randn(*shape, generator=gen) for shape in shapes)
    return [q, latent, k_rot, weight * rank**-0.5, dout]  # (expanded keys of unit scale, as q's)


def _reference(opts: str, heads: int = HEADS) -> list[np.ndarray]:
    q, latent, k_rot, weight, dout = (t.clone() for t in _whole(heads))
    inputs = [t.requires_grad_() for t in (q, latent, k_rot, weight)]
    k, v = LatentKV(weight, NOPE, V).expand(latent, k_rot)
    p, draws = OPTS[opts]
    out = causal_attention(
        q,
        k,
        v,
        causal_mask(SEQ),
        scale=SCALE,
        softmax_dtype=torch.float32,
        dropout=p,
        training=True,
        draws=draws,
    )
    out = out.view(BATCH, SEQ, heads, V).transpose(1, 2)
    out.backward(dout)
    return [t.detach().double().numpy() for t in (out, *(x.grad for x in inputs))]


def _rank(comm: Comm, opts: str) -> dict:
    comm = comm.instrumented(check=False)
    pos = chunks.positions(SEQ, comm.size, comm.rank)
    q, latent, k_rot, weight, dout = _whole()
    q, k_rot, dout = (t[..., pos, :].clone() for t in (q, k_rot, dout))
    latent = latent[:, pos].clone()
    inputs = [t.requires_grad_() for t in (q, latent, k_rot, weight)]
    p, draws = OPTS[opts]
    factors = WeightsDropout(p, draws, SEQ).rows(q, pos)
    up = LatentKV(weight, NOPE, V)
    before = sum(comm.stats.bytes_sent.values())
    out = latent_ring_attention(
        q, latent, k_rot, up, comm, pos, scale=SCALE, softmax_dtype=torch.float32, dropout=factors
    )
    out.backward(dout)
    latent_bytes = sum(comm.stats.bytes_sent.values()) - before
    with torch.no_grad():  # the same ring sending the expanded keys and values
        k, v = up.expand(latent, k_rot)
    k, v = k.requires_grad_(), v.requires_grad_()
    before = sum(comm.stats.bytes_sent.values())
    ring_attention(
        q.detach(), k, v, comm, pos, scale=SCALE, softmax_dtype=torch.float32, dropout=factors
    ).backward(dout)
    expanded_bytes = sum(comm.stats.bytes_sent.values()) - before
    grads = [t.detach().double().numpy() for t in (out, *(x.grad for x in inputs))]
    return {"pos": pos.numpy(), "grads": grads, "bytes": (latent_bytes, expanded_bytes)}


def _errors(want: list[np.ndarray], ranks: list[dict]) -> dict[str, float]:
    """Each rank's rows against the reference's, relative to each tensor's largest entry; (batch,
    heads, tokens, width) tensors by their rows' positions, the latent's too; the up-projection's
    gradient summed over the ranks."""
    size = [float(np.abs(w).max()) for w in want]
    errors = {}
    for name, i in (("out", 0), ("dq", 1), ("d_rot", 3)):
        errors[name] = (
            max(float(np.abs(r["grads"][i] - want[i][..., r["pos"], :]).max()) for r in ranks) / size[i]
        )
    errors["d_latent"] = (
        max(float(np.abs(r["grads"][2] - want[2][:, r["pos"]]).max()) for r in ranks) / size[2]
    )
    errors["d_weight"] = float(np.abs(sum(r["grads"][4] for r in ranks) - want[4]).max()) / size[4]
    return errors


@pytest.mark.parametrize("opts", list(OPTS))
@pytest.mark.parametrize("cp", [2, 4])
def test_the_latent_ring_is_the_expanded_attention(cp, opts):
    errors = _errors(_reference(opts), run_ranks(_rank, cp, opts))
    assert max(errors.values()) <= 1e-6, errors


def _alltoall_rank(comm: Comm, opts: str, rank: int = RANK) -> dict:
    """This rank's output and gradients through the all-to-all with the latent gathered, and the
    bytes it sent by collective kind: that route's, then the same route's with the expanded keys
    and values (ulysses_attention)."""
    comm = comm.instrumented(check=False)
    pos = chunks.positions(SEQ, comm.size, comm.rank)
    q, latent, k_rot, weight, dout = _whole(SPLIT_HEADS, rank)
    q, k_rot, dout = (t[..., pos, :].clone() for t in (q, k_rot, dout))
    latent = latent[:, pos].clone()
    inputs = [t.requires_grad_() for t in (q, latent, k_rot, weight)]
    p, draws = OPTS[opts]
    up, split = LatentKV(weight, NOPE, V), ContextSplit(comm, "alltoall")
    kwargs = dict(scale=SCALE, softmax_dtype=torch.float32, dropout=p, training=True, draws=draws)
    out = latent_causal_attention(q, latent, k_rot, up, causal_mask(SEQ), context=split, **kwargs)
    out = out.view(BATCH, -1, SPLIT_HEADS, V).transpose(1, 2)
    out.backward(dout)
    sent = dict(comm.stats.bytes_sent)
    with torch.no_grad():
        k, v = up.expand(latent, k_rot)
    k, v = k.requires_grad_(), v.requires_grad_()

    def whole(*qkv, share):  # one process's attention, heads unmerged
        out = causal_attention(*qkv, causal_mask(SEQ), scale=SCALE, softmax_dtype=torch.float32)
        return out.view(BATCH, SEQ, -1, V).transpose(1, 2)

    ulysses_attention(q.detach().requires_grad_(), k, v, comm, whole).backward(dout)
    expanded = {kind: comm.stats.bytes_sent[kind] - sent[kind] for kind in sent}
    grads = [t.detach().double().numpy() for t in (out, *(x.grad for x in inputs))]
    return {"pos": pos.numpy(), "grads": grads, "bytes": (sent, expanded)}


@pytest.mark.parametrize("opts", list(OPTS))
@pytest.mark.parametrize("cp", [2, 4])
def test_the_gathered_latent_is_the_expanded_attention(cp, opts):
    errors = _errors(_reference(opts, SPLIT_HEADS), run_ranks(_alltoall_rank, cp, opts))
    assert max(errors.values()) <= 1e-6, errors


@pytest.mark.parametrize("cp", [2, 4])
def test_the_all_to_all_gathers_the_latent_instead_of_moving_the_keys_and_values(cp):
    """Forward and backward: the latent route's gather and scatter move (cp - 1) x tokens x (rank +
    rope) floats a rank, both ways; its all-to-alls (the queries and the output) are the expanded
    route's less the keys' and values': (cp - 1) / cp x tokens x heads x (nope + rope + v), both ways."""
    local = BATCH * SEQ // cp
    for r in run_ranks(_alltoall_rank, cp, "plain"):
        latent, expanded = r["bytes"]
        assert latent["all_gather"] == latent["reduce_scatter"] == (cp - 1) * local * (RANK + ROPE) * 4
        assert expanded["all_gather"] == expanded["reduce_scatter"] == 0
        kv = 2 * (cp - 1) * local * SPLIT_HEADS * (NOPE + ROPE + V) * 4 // cp  # both ways
        assert expanded["all_to_all"] - latent["all_to_all"] == kv


@pytest.mark.parametrize("cp", [2, 4])
def test_the_latent_travels_instead_of_the_keys_and_values(cp):
    """Forward and backward, every message a rank sends is the latent's size (or its gradient's):
    (rank + rope) / (heads x (nope + rope + v)) of the expanded keys' and values' bytes."""
    for r in run_ranks(_rank, cp, "plain"):
        latent_bytes, expanded_bytes = r["bytes"]
        assert latent_bytes > 0
        assert latent_bytes * HEADS * (NOPE + ROPE + V) == expanded_bytes * (RANK + ROPE)


def test_the_all_to_all_expands_first_where_the_latent_is_the_wider():
    """4 heads of (6 + 4) + 5 expanded: 60 floats a token, moved as (cp - 1) / cp of them; a latent
    of 40 + 4 gathered from 2 ranks sends 44 (more than 30): the keys and values move, as before.
    DeepSeek-V3's (128 heads of 192 + 128, a latent of 512 + 64) gathers up to 71 ranks."""
    for r in run_ranks(_alltoall_rank, 2, "plain", 40):
        latent, expanded = r["bytes"]
        assert latent["all_gather"] == latent["reduce_scatter"] == 0
        assert latent["all_to_all"] == expanded["all_to_all"]
    assert [n for n in range(2, 100) if gathering_sends_less(128, 192, 128, 576, n)] == list(range(2, 72))
