"""Packed documents (data.document_mask, distlib/parallel/documents.py; issue 39 item 4): where each
token's document starts, against a loop (one-token documents, an end token first and last, none);
the mask is causal inside one document; a packed sequence's logits are each document's run alone
(every family, within 1e-6); torch's fused attention agrees; and the ring attends exactly that
across 2 and 4 ranks -- rows that see no key of a block, blocks that no query reaches skipped --
forward and backward, with dropout too. The layouts' training runs are
tests/test_document_mask_train.py's."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from family_models import built, max_diff, quiet_transformers
from multiproc import run_ranks
from trainrun import compose_tree

from distlib.app.config.run import RunConfig
from distlib.app.data.batches import HeldOut
from distlib.app.model import families, llama
from distlib.app.model import hf_weights as hfw
from distlib.app.model.attention import WeightsDropout, causal_attention, causal_mask
from distlib.app.observe.validation import Validation
from distlib.comm.group import Comm
from distlib.parallel.context import balance, chunks
from distlib.parallel.context.ring import RingStats, block_count, ring_attention
from distlib.parallel.documents import Documents
from distlib.parallel.dropout import Draws

END = 5  # the end-of-document token of these tests


def _loop_starts(row: list[int]) -> list[int]:
    starts, start = [], 0
    for t in range(len(row)):
        if t > 0 and row[t - 1] == END:
            start = t
        starts.append(start)
    return starts


@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0])
def test_each_token_knows_where_its_document_starts(density):
    """A document starts at 0 and after every end token (which is its own document's last), so
    consecutive end tokens are one-token documents and an end token last starts nothing."""
    gen = torch.Generator().manual_seed(int(density * 10))
    for seq in (1, 2, 7, 33):
        tokens = torch.randint(6, 20, (3, seq), generator=gen)
        tokens[torch.rand(3, seq, generator=gen) < density] = END
        got = Documents.of_tokens(tokens, END).starts
        assert got.tolist() == [_loop_starts(row) for row in tokens.tolist()]


def test_the_mask_is_causal_inside_each_document():
    tokens = torch.tensor([[END, 7, 8, END, END, 9, 10, 11, END, 12], [7] * 9 + [END]])
    docs = Documents.of_tokens(tokens, END)
    queries, keys = torch.tensor([9, 0, 4, 6]), torch.arange(10)
    got = docs.mask(queries, keys)
    assert got.shape == (2, 1, 4, 10)
    for b, row in enumerate(tokens.tolist()):
        starts = _loop_starts(row)
        for i, q in enumerate(queries.tolist()):
            want = [starts[k] == starts[q] and k <= q for k in range(10)]
            assert got[b, 0, i].tolist() == want
    assert torch.equal(docs.whole_mask(), docs.mask(keys, keys))
    assert torch.equal(docs.within(torch.tensor([0, 3, 4, 9])), torch.tensor([[0, 2, 0, 0], [0, 3, 4, 9]]))


def _packed(seq: int, vocab: int) -> torch.Tensor:
    """Two sequences of documents: one-token ones, an end token first and last; the other one long
    document after a short one."""
    x = torch.randint(END + 1, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    x[0, [0, 3, 4, 10, seq - 5, seq - 1]] = END
    x[1, [1]] = END
    return x


@pytest.mark.parametrize("family", list(families.CLASSES))
def test_a_packed_sequence_computes_each_document_alone(family):
    """Attention stays inside each document and positions restart at each (rotary angles and
    learned embeddings alike): a document's logits are those of it run alone, within 1e-6; without
    the documents they are not."""
    cfg = RunConfig.from_dict(compose_tree([f"model={family}", "model.seq_len=32"])).model
    torch.set_num_threads(1)
    model = families.build(cfg, 0).eval()
    x = _packed(32, cfg.vocab_size)
    docs = Documents.of_tokens(x, END)
    with torch.no_grad():
        packed, plain = model(x, documents=docs), model(x)
        worst = 0.0
        for b in range(2):
            bounds = sorted(set(docs.starts[b].tolist())) + [32]
            for start, end in zip(bounds, bounds[1:]):
                alone = model(x[b : b + 1, start:end])[0]
                worst = max(worst, float((alone - packed[b, start:end]).abs().max()))
    assert worst <= 1e-6, worst
    assert float((plain - packed).abs().max()) > 1e-2  # the documents matter


@pytest.mark.parametrize("family", [f for f in families.CLASSES if f != "minigpt"])
def test_packed_logits_are_transformers_on_packed_position_ids(family, tmp_path):
    """transformers reads packed documents from position ids that restart (masking_utils'
    find_packed_sequence_indices; without a cache, as in training): its eager model, loaded from
    our export, gives our packed logits within 1e-5."""
    transformers = quiet_transformers()
    cfg = RunConfig.from_dict(compose_tree([f"model={family}", "model.seq_len=32"])).model
    ours = built(cfg, seed=3)
    hfw.save_hf_dir(cfg, ours.state_dict(), tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    x = _packed(32, cfg.vocab_size)
    docs = Documents.of_tokens(x, END)
    with torch.no_grad():
        want = theirs(input_ids=x, position_ids=docs.within(torch.arange(32)), use_cache=False).logits
        assert max_diff(ours(x, documents=docs), want) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "deepseek_v3"])
def test_rotary_angles_restart_at_each_document(family, monkeypatch):
    """Rotary attention depends on relative positions only, so the logits above match alone even
    with the sequence's positions (within rounding): the angles themselves are checked. Every
    attention rotates by the positions within documents, 0 at each document's first token."""
    cfg = RunConfig.from_dict(compose_tree([f"model={family}", "model.seq_len=32"])).model
    model = families.build(cfg, 0).eval()
    seen = []
    tables = llama.rope_tables
    monkeypatch.setattr(llama, "rope_tables", lambda f, p, d: seen.append(p) or tables(f, p, d))
    x = _packed(32, cfg.vocab_size)
    docs = Documents.of_tokens(x, END)
    with torch.no_grad():
        model(x, documents=docs)
    assert len(seen) == cfg.n_layers
    starts = torch.tensor([_loop_starts(row) for row in x.tolist()])
    for positions in seen:
        assert torch.equal(positions, torch.arange(32) - starts)


def test_fused_attention_keeps_the_documents_too():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen) for _ in range(3))
    docs = Documents.of_tokens(_packed(16, 30), END)
    opts = dict(scale=8**-0.5, documents=docs)
    explicit = causal_attention(q, k, v, causal_mask(16), **opts)
    fused = causal_attention(q, k, v, causal_mask(16), sdpa=True, **opts)
    assert float((explicit - fused).abs().max()) <= 1e-6


SEQ, BATCH, HEADS, DIM = 16, 2, 3, 8
# sample 0: documents [0-5] [6] [7-12] [13-15]; sample 1: [0-2] [3-13] [14-15]. At cp 2 (chunks of
# 4) the rows 12-15 of sample 0 see no key of chunk 0, which sample 1's row 12 does; at cp 4
# (chunks of 2) no query of chunk 7 reaches chunks 0-5.
ENDS = ([5, 6, 12], [2, 13])
OPTS = {
    "multiply": {"scale": DIM**-0.5},
    "softmax_f32": {"scale": DIM**-0.5, "softmax_dtype": torch.float32},
    "dropout": {"scale": DIM**-0.5, "dropout": 0.3, "training": True, "draws": Draws(3, (11, 12))},
}


def _documents() -> Documents:
    tokens = torch.full((BATCH, SEQ), END + 1)
    for b, ends in enumerate(ENDS):
        tokens[b, ends] = END
    return Documents.of_tokens(tokens, END)


def _whole() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(BATCH, HEADS, SEQ, DIM, generator=gen) for _ in range(4)]


def _reference(opts: dict) -> list[np.ndarray]:
    q, k, v, dout = _whole()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = causal_attention(q, k, v, causal_mask(SEQ), **opts, documents=_documents())
    out = out.view(BATCH, SEQ, HEADS, DIM).transpose(1, 2)
    out.backward(dout)
    return [t.detach().double().numpy() for t in (out, q.grad, k.grad, v.grad)]


def _ring(comm: Comm, opts: dict):
    owned = balance.owned(_documents(), comm.size)
    whole, pos = _whole(), chunks.positions(SEQ, comm.size, comm.rank, owned=owned)
    q, k, v = (t[..., pos, :].clone().requires_grad_() for t in whole[:3])
    opts, stats = dict(opts), RingStats()
    p, training, draws = opts.pop("dropout", 0.0), opts.pop("training", False), opts.pop("draws", None)
    factors = WeightsDropout(p if training else 0.0, draws, SEQ).rows(q, pos)
    out = ring_attention(q, k, v, comm, pos, **opts, dropout=factors, stats=stats, documents=_documents())
    out.backward(whole[3][..., pos, :])
    got = [t.detach().double().numpy() for t in (out, q.grad, k.grad, v.grad)]
    return pos.numpy(), got, (stats.forward_blocks, stats.backward_blocks)


@functools.cache
def _results(cp: int, opts: str):
    return run_ranks(_ring, cp, OPTS[opts])


@pytest.mark.parametrize("opts", list(OPTS))
@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_attends_inside_each_document(cp, opts):
    """out, dq, dk, dv of every rank's rows within 1e-6 of one process's (no NaN from a row that
    sees no key of a block)."""
    want = _reference(OPTS[opts])
    for pos, got, _ in _results(cp, opts):
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            error = float(np.nan_to_num(np.abs(g - w[..., pos, :]), nan=np.inf).max())
            assert error <= 1e-6, (name, error)


def test_a_row_may_see_no_key_of_a_block():
    """The case the ring's empty rows handle is there: at cp 2, rank 0's query chunk 3 attends
    key chunk 0 (sample 1's row 12 reaches it) while sample 0's rows 12-15 see none of it."""
    mask = _documents().mask(torch.arange(12, 16), torch.arange(0, 4))
    assert bool(mask[1].any()) and not bool(mask[0].any())


@pytest.mark.parametrize("cp", [2, 4])
def test_blocks_no_query_reaches_are_skipped(cp):
    """Each rank attends exactly the pairs its query chunks reach (``balance.chunk_work``: at cp 4
    chunk 7 reaches chunks 6 and 7 only), the same forward and backward, and the busiest rank no
    more than causal attention's 2 cp + 1."""
    blocks = [b for *_, b in _results(cp, "multiply")]
    chunk = SEQ // (2 * cp)
    work = balance.chunk_work(_documents().chunk_starts(chunk), chunk)
    owned = balance.owned(_documents(), cp)
    assert [tuple(b) for b in blocks] == [(work[x] + work[y],) * 2 for x, y in owned]
    assert max(f for f, _ in blocks) <= block_count(cp, 0)
    if cp == 4:
        assert work[7] == 2


def test_the_ring_balances_the_chunks_for_the_documents():
    """At cp 4 the chunks' work is [1, 2, 3, 3, 4, 5, 6, 2]: the zig-zag's busiest rank attends 8
    pairs (chunks 1 and 6, 2 and 5), the balanced pairs at most 7 (26 pairs over 4 ranks), and the
    ring counts that many on each rank."""
    work = balance.chunk_work(_documents().chunk_starts(2), 2)
    assert work == [1, 2, 3, 3, 4, 5, 6, 2]
    zigzag = [work[a] + work[b] for a, b in chunks.zigzag(4)]
    counted = [f for *_, (f, _) in _results(4, "multiply")]
    assert max(zigzag) == 8 and max(counted) == 7 and sum(counted) == sum(zigzag)


def test_validation_scores_the_held_out_windows_as_packed_documents():
    """train.eval_every with the masks: each held-out window is scored with its documents' masks
    (the mean per token of the model's loss on them), not as one text."""
    cfg = RunConfig.from_dict(compose_tree(["model=llama", "model.seq_len=16"])).model
    model = families.build(cfg, 0)
    tokens = torch.randint(END + 1, cfg.vocab_size, (16 * 4 + 1,), generator=torch.Generator().manual_seed(2))
    tokens[torch.arange(3, 65, 7)] = END
    held = HeldOut(tokens.numpy(), 16, 4)
    one = Comm(ranks=(0,), rank=0)
    got = Validation(1, held, model, one, 2, "cpu", ends=END).loss()
    plain = Validation(1, held, model, one, 2, "cpu").loss()
    with torch.no_grad():
        model.eval()
        losses = [float(model(x, y, documents=Documents.of_tokens(x, END))) for x, y in held.batches(0, 1, 2)]
    assert got == pytest.approx(sum(losses) / len(losses), rel=1e-6) and abs(got - plain) > 1e-4
