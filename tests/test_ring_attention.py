"""Ring attention (distlib/parallel/context/ring.py) against the single-process explicit causal
attention (distlib/app/model/attention.py) on 2 and 4 gloo ranks: every rank draws the same whole
sequence from a seed, takes its ``chunks`` rows, runs the ring forward and backward, and its
output and dq/dk/dv rows must match the whole-sequence reference's (with dropout on the weights
too: the keyed masks, distlib/parallel/dropout.py); twice, bitwise; with every rank attending as
many (query chunk, key chunk) pairs."""

import functools
import time

import numpy as np
import pytest
import torch
from multiproc import run_ranks

from distlib.app.model.attention import WeightsDropout, causal_attention, causal_mask
from distlib.comm.group import Comm
from distlib.parallel.context import chunks
from distlib.parallel.context.ring import RingStats, block_count, ring_attention
from distlib.parallel.dropout import Draws

SEQ, BATCH, HEADS, DIM = 16, 2, 3, 8
OPTS = {
    "multiply": {"scale": DIM**-0.5},
    "divide": {"scale": DIM**0.5, "divide": True},  # MiniGPT's
    "softmax_f32": {"scale": DIM**-0.5, "softmax_dtype": torch.float32},  # Llama's
    # the weights dropped (p 0.3) with two samples' keyed masks: the ring takes its rows' factors
    "dropout": {"scale": DIM**-0.5, "dropout": 0.3, "training": True, "draws": Draws(3, (11, 12))},
}
NAMES = ("out", "dq", "dk", "dv")


def _whole(dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v and the upstream gradient of the whole sequence, the same on every rank."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(BATCH, HEADS, SEQ, DIM, generator=gen).to(dtype) for _ in range(4)]


def _reference(dtype: torch.dtype, opts: dict, compute: torch.dtype | None = None) -> list[np.ndarray]:
    """The whole sequence's output and gradients, (batch, heads, seq, head_dim) each; ``compute``:
    run it in another dtype from the same (rounded) inputs."""
    q, k, v, dout = (t.to(compute or dtype) for t in _whole(dtype))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = causal_attention(q, k, v, causal_mask(SEQ), **opts)
    out = out.view(BATCH, SEQ, HEADS, DIM).transpose(1, 2)  # heads apart again
    out.backward(dout)
    return [t.detach().double().numpy() for t in (out, q.grad, k.grad, v.grad)]


def _ring(comm: Comm, whole: list[torch.Tensor], pos: torch.Tensor, opts: dict):
    q, k, v = (t[..., pos, :].clone().requires_grad_() for t in whole[:3])
    stats = RingStats()
    opts = dict(opts)
    p, training, draws = opts.pop("dropout", 0.0), opts.pop("training", False), opts.pop("draws", None)
    factors = WeightsDropout(p if training else 0.0, draws, SEQ).rows(q, pos)
    out = ring_attention(q, k, v, comm, pos, **opts, dropout=factors, stats=stats)
    out.backward(whole[3][..., pos, :])
    return [t.detach().double().numpy() for t in (out, q.grad, k.grad, v.grad)], stats


def _rank(comm: Comm, dtype: torch.dtype, opts: dict):
    whole, pos = _whole(dtype), chunks.positions(SEQ, comm.size, comm.rank)
    first, stats = _ring(comm, whole, pos, opts)
    if comm.rank == 0:
        time.sleep(0.05)  # the blocks arrive at other moments the second time
    second, _ = _ring(comm, whole, pos, opts)
    return pos.numpy(), first, second, (stats.forward_blocks, stats.backward_blocks)


@functools.cache
def _results(cp: int, dtype: torch.dtype, opts: str):
    return run_ranks(_rank, cp, dtype, OPTS[opts])


def _error(got: np.ndarray, want: np.ndarray) -> float:
    """Max abs difference; a NaN (a row with every key masked) is infinitely wrong, not skipped."""
    return float(np.nan_to_num(np.abs(got - want), nan=np.inf).max())


def _errors(cp: int, dtype: torch.dtype, opts: str, reference: list[np.ndarray]) -> list[float]:
    """Max abs error over the ranks of out, dq, dk, dv against ``reference``'s rows."""
    worst = [0.0] * 4
    for pos, got, _, _ in _results(cp, dtype, opts):
        for i, (g, r) in enumerate(zip(got, reference)):
            worst[i] = max(worst[i], _error(g, r[..., pos, :]))
    return worst


@pytest.mark.parametrize("opts", list(OPTS))
@pytest.mark.parametrize("cp", [2, 4])
def test_matches_single_process_fp32(cp, opts):
    errors = _errors(cp, torch.float32, opts, _reference(torch.float32, OPTS[opts]))
    print(f"cp={cp} {opts}: max abs error " + " ".join(f"{n} {e:.1e}" for n, e in zip(NAMES, errors)))
    assert max(errors) <= 1e-6, dict(zip(NAMES, errors))


@pytest.mark.parametrize("opts", ["multiply", "softmax_f32"])
@pytest.mark.parametrize("cp", [2, 4])
def test_bf16_as_close_as_the_reference(cp, opts):
    """bf16 keeps 8 bits of mantissa (relative rounding 2^-9): neither the ring nor the reference
    can match float arithmetic closer than a few of those on O(1) values, and the two round at
    different places (the ring's partials, its float32 merge and float32 backward). So both are
    measured against float64 on the same rounded inputs: the ring must be no further than twice
    the reference's own bf16 error, and within 3e-2 absolute."""
    truth = _reference(torch.bfloat16, OPTS[opts], compute=torch.float64)
    ring = _errors(cp, torch.bfloat16, opts, truth)
    ref = [_error(r, t) for r, t in zip(_reference(torch.bfloat16, OPTS[opts]), truth)]
    print(f"cp={cp} bf16 {opts}: ring " + " ".join(f"{n} {e:.1e}" for n, e in zip(NAMES, ring)))
    print(f"cp={cp} bf16 {opts}: reference " + " ".join(f"{n} {e:.1e}" for n, e in zip(NAMES, ref)))
    for name, r, e in zip(NAMES, ring, ref):
        assert r <= 2 * e and r <= 3e-2, f"{name}: ring {r:.2e}, reference {e:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cp", [2, 4])
def test_deterministic(cp, dtype):
    for rank, (_, first, second, _) in enumerate(_results(cp, dtype, "multiply")):
        for name, a, b in zip(NAMES, first, second):
            assert np.array_equal(a, b), f"rank {rank} {name}: two runs differ"


@pytest.mark.parametrize("cp", [2, 4])
def test_balanced(cp):
    """Every rank attends 2 cp + 1 pairs, forward and backward: the zig-zag layout's balance, and
    fewer than the 4 cp a rank would attend without skipping the masked ones."""
    counts = [blocks for *_, blocks in _results(cp, torch.float32, "multiply")]
    forward = [f for f, _ in counts]
    assert max(forward) - min(forward) <= 1, counts
    assert counts == [(block_count(cp, r), block_count(cp, r)) for r in range(cp)]
    assert forward == [2 * cp + 1] * cp


def test_block_count_every_size():
    for cp in range(1, 9):
        assert [block_count(cp, r) for r in range(cp)] == [2 * cp + 1] * cp


@pytest.mark.parametrize("opts", list(OPTS))
def test_one_rank_is_the_whole_sequence(opts):
    """cp = 1 sends nothing (no process group needed): the ring is one step of two chunks."""
    whole, pos = _whole(torch.float32), chunks.positions(SEQ, 1, 0)
    got, stats = _ring(Comm(ranks=(0,), rank=0), whole, pos, OPTS[opts])
    for name, g, r in zip(NAMES, got, _reference(torch.float32, OPTS[opts])):
        assert _error(g, r) <= 1e-6, name
    assert stats.forward_blocks == stats.backward_blocks == 3


def _grouped(kv_heads: int) -> list[torch.Tensor]:
    """q (4 heads), k and v (``kv_heads``: grouped-query) and the upstream gradient, whole sequence."""
    gen = torch.Generator().manual_seed(99)
    shapes = [
        (BATCH, 4, SEQ, DIM),
        (BATCH, kv_heads, SEQ, DIM),
        (BATCH, kv_heads, SEQ, DIM),
        (BATCH, 4, SEQ, DIM),
    ]
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def _grouped_ring(comm: Comm, kv_heads: int):
    pos = chunks.positions(SEQ, comm.size, comm.rank)
    got, _ = _ring(comm, _grouped(kv_heads), pos, OPTS["softmax_f32"])
    return pos.numpy(), got


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("cp", [2, 4])
def test_grouped_query_heads_travel_grouped_and_match_the_reference(cp, kv_heads):
    """k and v with fewer heads than q go around the ring as they are (repeated where a block is
    attended, their gradients folded back before they travel): out, dq, dk, dv match one process's."""
    q, k, v, dout = (t.clone() for t in _grouped(kv_heads))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = causal_attention(q, k, v, causal_mask(SEQ), **OPTS["softmax_f32"])
    out.view(BATCH, SEQ, 4, DIM).transpose(1, 2).backward(dout)
    want = [out.view(BATCH, SEQ, 4, DIM).transpose(1, 2), q.grad, k.grad, v.grad]
    for pos, got in run_ranks(_grouped_ring, cp, kv_heads):
        assert got[2].shape == (BATCH, kv_heads, len(pos), DIM)  # dk in the grouped heads
        # relative to each tensor's largest entry: a kv head's gradient sums 4/kv_heads heads' terms
        errors = [
            _error(g, w.detach().double().numpy()[..., pos, :]) / float(w.detach().abs().max())
            for g, w in zip(got, want)
        ]
        assert max(errors) <= 1e-6, dict(zip(NAMES, errors))
