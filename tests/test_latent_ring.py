"""Ring attention with the latent travelling (distlib/parallel/context/latent_ring.py, DeepSeek-V3's
multi-head latent attention under dist.cp_impl=ring) against one process's attention of the
expanded keys and values, on 2 and 4 gloo ranks: the output and the gradients of the queries, the
latent, the shared rotary key (each rank's rows) and the up-projection (summed over the ranks);
with the keyed dropout masks too; and the bytes the ring sends, against the same ring sending
the expanded keys and values: (rank + rope) / (heads x (nope + rope + v)) of them, exactly."""

import numpy as np
import pytest
import torch
from multiproc import run_ranks

from distlib.app.model.attention import WeightsDropout, causal_attention, causal_mask
from distlib.comm.group import Comm
from distlib.parallel.context import chunks
from distlib.parallel.context.latent_ring import latent_ring_attention
from distlib.parallel.context.ring import ring_attention
from distlib.parallel.context.travel import LatentKV
from distlib.parallel.dropout import Draws

SEQ, BATCH, HEADS, NOPE, ROPE, V, RANK = 16, 2, 3, 6, 4, 5, 7
SCALE = (NOPE + ROPE) ** -0.5
OPTS = {"plain": (0.0, None), "dropout": (0.3, Draws(3, (11, 12)))}


def _whole() -> list[torch.Tensor]:
    """q, latent, the rotary key, the up-projection and the upstream gradient of the whole sequence."""
    gen = torch.Generator().manual_seed(77)
    shapes = [
        (BATCH, HEADS, SEQ, NOPE + ROPE),
        (BATCH, SEQ, RANK),
        (BATCH, 1, SEQ, ROPE),
        (HEADS * (NOPE + V), RANK),
        (BATCH, HEADS, SEQ, V),
    ]
    q, latent, k_rot, weight, dout = (torch.randn(*shape, generator=gen) for shape in shapes)
    return [q, latent, k_rot, weight * RANK**-0.5, dout]  # (expanded keys of unit scale, as q's)


def _reference(opts: str) -> list[np.ndarray]:
    q, latent, k_rot, weight, dout = (t.clone() for t in _whole())
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
    out = out.view(BATCH, SEQ, HEADS, V).transpose(1, 2)
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


@pytest.mark.parametrize("opts", list(OPTS))
@pytest.mark.parametrize("cp", [2, 4])
def test_the_latent_ring_is_the_expanded_attention(cp, opts):
    want = _reference(opts)
    ranks = run_ranks(_rank, cp, opts)
    # relative to each tensor's largest entry; (batch, heads, tokens, width) tensors by their rows'
    # positions, the latent's too
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
    assert max(errors.values()) <= 1e-6, errors


@pytest.mark.parametrize("cp", [2, 4])
def test_the_latent_travels_instead_of_the_keys_and_values(cp):
    """Forward and backward, every message a rank sends is the latent's size (or its gradient's):
    (rank + rope) / (heads x (nope + rope + v)) of the expanded keys' and values' bytes."""
    for r in run_ranks(_rank, cp, "plain"):
        latent_bytes, expanded_bytes = r["bytes"]
        assert latent_bytes > 0
        assert latent_bytes * HEADS * (NOPE + ROPE + V) == expanded_bytes * (RANK + ROPE)
