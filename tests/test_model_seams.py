"""The model's seams (#32 item 3): every family reaches the one attention function, positions are
handed in (a slice of a sequence knows where it is), the families share their block, and the
tensor-parallel plan splits any module that declares how."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from family_models import GPT2_UNTIED, LLAMA_GQA, built, max_diff, tokens

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import attention, families
from distlib.app.model.layers import PreNormBlock
from distlib.comm.group import Comm
from distlib.parallel.tensor_parallel import (
    Column,
    ColumnParallelLinear,
    Split,
    parallelize_,
    shard_of,
)

MINIGPT = ModelConfig(seq_len=20)
FAMILIES = {"minigpt": MINIGPT, "gpt2": GPT2_UNTIED, "llama": LLAMA_GQA}
IDS = list(FAMILIES)


def _capture(monkeypatch) -> list[dict]:
    """Patch the one attention function with a recorder that still computes it: each call's
    q, k and keyword arguments."""
    calls, real = [], attention.causal_attention

    def recorder(q, k, v, mask, **kw):
        calls.append({"q": q, "k": k, **kw})
        return real(q, k, v, mask, **kw)

    monkeypatch.setattr(attention, "causal_attention", recorder)
    return calls


@pytest.mark.parametrize("cfg", FAMILIES.values(), ids=IDS)
def test_every_family_calls_the_one_attention_function(cfg, monkeypatch):
    model, x = built(cfg), tokens(cfg, 2, cfg.seq_len, 1)
    with torch.no_grad():
        expected = model(x)
        calls = _capture(monkeypatch)
        assert torch.equal(model(x), expected)  # the recorder computes the same
    assert len(calls) == cfg.n_layers  # every block's attention, none of its own
    # each family's own arithmetic is an argument: MiniGPT divides, Llama's softmax is float32
    assert {c.get("divide", False) for c in calls} == {cfg.family == "minigpt"}
    float32 = {c.get("softmax_dtype") for c in calls} == {torch.float32}
    assert float32 == (cfg.family == "llama")


@pytest.mark.parametrize("cfg", FAMILIES.values(), ids=IDS)
def test_the_sdpa_path_is_the_explicit_one_within_rounding(cfg, monkeypatch):
    """No family selects torch's fused path (it changes the bits); it computes the same."""
    model, x = built(cfg), tokens(cfg, 2, cfg.seq_len, 2)
    real = attention.causal_attention
    with torch.no_grad():
        explicit = model(x)
        monkeypatch.setattr(attention, "causal_attention", lambda *a, **kw: real(*a, **kw, sdpa=True))
        fused = model(x)
    assert max_diff(fused, explicit) <= 1e-5 and not torch.equal(fused, explicit)


@pytest.mark.parametrize("cfg", FAMILIES.values(), ids=IDS)
def test_a_slice_embeds_and_rotates_as_the_whole_sequence_does(cfg, monkeypatch):
    """Tokens [a, b) with positions a..b-1: their embeddings (learned positions) and their rotated
    q and k (Llama) are the whole sequence's rows a..b-1, bit for bit."""
    model, x = built(cfg), tokens(cfg, 2, cfg.seq_len, 3)
    a, b = 5, 12
    positions = torch.arange(a, b)
    calls = _capture(monkeypatch)
    with torch.no_grad():
        assert torch.equal(model.embed(x[:, a:b], positions), model.embed(x)[:, a:b])
        h = model.embed(x)
        block = model.blocks[0]
        block(h)
        block(h[:, a:b], positions)
    full, part = calls
    for t in ("q", "k"):
        assert torch.equal(part[t], full[t][:, :, a:b])
    if cfg.family != "llama":  # learned positions: the slice at 0..b-a-1 embeds differently
        assert not torch.equal(model.embed(x[:, a:b]), model.embed(x)[:, a:b])


@pytest.mark.parametrize("cfg", FAMILIES.values(), ids=IDS)
def test_shifted_positions_change_what_depends_on_them(cfg, monkeypatch):
    """Learned positions: other logits. Rotary: other q and k, but scores that depend only on the
    distance between query and key, so the logits agree within rounding (RoPE is relative)."""
    model, x = built(cfg), tokens(cfg, 2, cfg.seq_len - 3, 4)
    shifted = torch.arange(3, cfg.seq_len)
    calls = _capture(monkeypatch)
    with torch.no_grad():
        plain, moved = model(x), model(x, positions=shifted)
    assert torch.equal(plain, model(x, positions=torch.arange(cfg.seq_len - 3)))  # the default
    if cfg.family == "llama":
        n = cfg.n_layers
        assert not torch.equal(calls[0]["q"], calls[n]["q"]) and not torch.equal(calls[0]["k"], calls[n]["k"])
        assert max_diff(plain, moved) <= 1e-5
    else:
        assert max_diff(plain, moved) > 1e-3
    with pytest.raises(ValueError, match=r"expected \(13,\), one per token"):
        model(x[:, :13], positions=torch.arange(13)[None])


@pytest.mark.parametrize("cfg", FAMILIES.values(), ids=IDS)
def test_the_families_share_one_block(cfg):
    block = families.build(cfg, 0).blocks[0]
    assert type(block) is PreNormBlock
    assert [n for n, _ in block.named_children()] == ["ln1", "attn", "ln2", "mlp"]


# -- a module that declares its own tensor-parallel split ------------------------------------------


class Experts(nn.Module):
    """A toy layer of experts that splits by whole experts: rank t keeps experts [t*E/T, (t+1)*E/T)."""

    def __init__(self, n: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, dim, dim, generator=torch.Generator().manual_seed(n)))
        self.styles = []

    def tp_shard(self, tp: Comm, style: object) -> nn.Module:
        self.styles.append(style)
        split = Split(dim=0, parts=tp.size, index=tp.rank)
        self.weight = nn.Parameter(shard_of(self.weight.detach(), split))
        self.splits = {"weight": split}
        return self


class FusedLinear(nn.Linear):
    """An nn.Linear that declares a split of its own (by input features): the declaration wins."""

    def tp_shard(self, tp: Comm, style: object) -> nn.Module:
        self.splits = {"weight": Split(dim=1, parts=tp.size, index=tp.rank)}
        return self


def _toy() -> nn.Module:
    return nn.ModuleDict(
        {"up": nn.Linear(4, 8), "experts": Experts(4, 3), "fused": FusedLinear(4, 4), "down": nn.Linear(8, 4)}
    )


def test_the_plan_splits_a_module_that_declares_how():
    model = _toy()
    names, full = [n for n, _ in model.named_parameters()], model["experts"].weight.detach().clone()
    plan = {"up": Column(), "experts": "by-expert", "fused": Column()}
    splits = parallelize_(model, Comm(ranks=(0, 1), rank=1), plan)
    assert [n for n, _ in model.named_parameters()] == names  # in place, same order
    assert model["experts"].styles == ["by-expert"]  # the plan's style, handed over as it is
    assert torch.equal(model["experts"].weight, full[2:])
    assert isinstance(model["up"], ColumnParallelLinear) and type(model["down"]) is nn.Linear  # as before
    assert type(model["fused"]) is FusedLinear
    assert splits == {
        "up.weight": Split(dim=0, parts=2, index=1),
        "up.bias": Split(dim=0, parts=2, index=1),
        "experts.weight": Split(dim=0, parts=2, index=1),
        "fused.weight": Split(dim=1, parts=2, index=1),
    }
    one = _toy()
    assert parallelize_(one, Comm(ranks=(0,), rank=0), plan) == {} and one["experts"].styles == []
    refused = "down, a ReLU, neither an nn.Linear, a SharedInput nor a module that declares"
    with pytest.raises(TypeError, match=refused):
        parallelize_(nn.ModuleDict({"down": nn.ReLU()}), Comm(ranks=(0,), rank=0), {"down": Column()})
