"""The model families' contract: structure, seeding, parameter count, the config rules of
model.family and its keys, the presets, tensor-parallel arithmetic (emulated and on real gloo
ranks) and activation checkpointing."""

from __future__ import annotations

import copy
import re
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from family_models import CONFIGS, GPT2_TIED, GPT2_UNTIED, LLAMA_GQA, built, max_diff, perturb_, tokens
from multiproc import run_ranks

from distlib.app.config import schema
from distlib.app.config.dimension_rules import check_tensor_parallel
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.run import GROUPS, ConfigError, RunConfig
from distlib.app.model import families
from distlib.app.model.minigpt import MiniGPT
from distlib.launch.hydra_config import CONF_DIR, compose_tree
from distlib.parallel.tensor_parallel import Column, Split, _matches, shard_of
from distlib.parallel.zero.units import unit_members, unit_modules

FAMILY_CONFIGS = list(CONFIGS.values())
IDS = list(CONFIGS)
MINIGPT_CONFIGS = [
    ModelConfig(),
    ModelConfig(vocab_size=50, seq_len=24, dim=48, n_heads=6, n_layers=3, mlp_ratio=2),
]


@pytest.mark.parametrize(
    "cfg", FAMILY_CONFIGS + [replace(c, n_layers=3) for c in FAMILY_CONFIGS] + MINIGPT_CONFIGS
)
def test_param_count_and_shapes_match_the_built_model(cfg):
    model = families.build(cfg, 0)
    assert families.param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert families.param_shapes(cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:  # counted once; untied, the head adds vocab x dim
        untied = families.param_count(replace(cfg, tie_embeddings=False))
        assert untied == families.param_count(cfg) + cfg.vocab_size * cfg.dim


@pytest.mark.parametrize(
    "cfg", [*FAMILY_CONFIGS, *MINIGPT_CONFIGS, "mixtral_tiny", "qwen3_moe", "deepseek_v3_tiny", "deepseek_v3"]
)
def test_the_active_parameters_are_those_a_token_meets(cfg):
    """MFU's P: all of a dense model's; of an MoE block's routed experts top_k (shared ones all)."""
    if isinstance(cfg, str):  # a preset
        cfg = RunConfig.from_dict(compose_tree([f"model={cfg}"])).model
    model = families.build(cfg, 0)
    unmet = sum(
        p.numel()
        for _, m in families.moe_blocks(model)
        for e in m.experts[cfg.top_k :]
        for p in e.parameters()
    )
    assert families.active_param_count(cfg) == sum(p.numel() for p in model.parameters()) - unmet
    assert (unmet > 0) == cfg.has_experts


def test_the_gpt2_124m_preset_is_gpt2_small():
    cfg = RunConfig.from_dict(compose_tree(["model=gpt2_124m"])).model
    assert (cfg.family, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.vocab_size, cfg.seq_len) == (
        "gpt2",
        12,
        768,
        12,
        50257,
        1024,
    )
    assert cfg.tie_embeddings and families.param_count(cfg) == 124_439_808  # GPT-2 small's published count


def test_every_preset_composes_and_sets_only_what_it_changes():
    presets = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    assert {"minigpt", "gpt2", "gpt2_124m", "llama", "llama_tiny", "llama_small"} <= set(presets)
    for name in presets:
        text = (CONF_DIR / "model" / f"{name}.yaml").read_text()
        values = yaml.safe_load(text) or {}
        if "# @package _global_" not in text:
            values = {"model": values}
        cfg = RunConfig.from_dict(compose_tree([f"model={name}"]))
        for group, keys in values.items():
            defaults = schema.defaults(GROUPS[group])
            assert all(keys[k] != defaults[k] for k in keys), (
                f"conf/model/{name}.yaml repeats a {group} default"
            )
            assert {k: getattr(getattr(cfg, group), k) for k in keys} == keys, name
        # invariant 1 (the loss never rises) is the capstone's own (RunConfig.departures): no preset
        # switches a check off (a preset may carry the learning rate and schedule its family trains
        # with); a family other than the capstone's makes a rising loss a warning
        outside = set(values) - {"model", "optimizer"}
        assert not outside, f"conf/model/{name}.yaml sets keys outside model and optimizer: {sorted(outside)}"
        assert name == "minigpt" or "model.family" in cfg.departures(), name


@pytest.mark.parametrize("cfg", FAMILY_CONFIGS, ids=IDS)
def test_parameters_live_in_top_level_children_in_forward_order(cfg):
    model = families.build(cfg, 0)
    assert not list(model.parameters(recurse=False))
    names = [name for name, child in model.named_children() if any(True for _ in child.parameters())]
    expected = list(model.EMBEDDINGS) + ["blocks"] + list(model.HEAD)
    assert names == expected and model.EMBEDDINGS == (
        ("tok_emb", "pos_emb") if cfg.family == "gpt2" else ("tok_emb",)
    )
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == cfg.n_layers
    # ZeRO-3's units: a tied head uses the embedding's unit instead of being one
    units = unit_modules(model)
    assert len(units) == len(expected) - 1 + cfg.n_layers - cfg.tie_embeddings
    assert [owner for m, owner in unit_members(model) if m is model.lm_head] == [
        0 if cfg.tie_embeddings else None
    ]
    # no buffer (mask, RoPE frequencies) in the state_dict; the tie is one Parameter
    assert set(model.state_dict()) == set(families.param_shapes(cfg))
    assert (model.lm_head.weight is model.tok_emb.weight) == cfg.tie_embeddings
    assert model.lm_head.bias is None


@pytest.mark.parametrize("cfg", FAMILY_CONFIGS + MINIGPT_CONFIGS[:1], ids=IDS + ["minigpt"])
def test_forward_is_embed_blocks_head(cfg):
    model = built(cfg)
    x = tokens(cfg, 2, cfg.seq_len, 1)
    with torch.no_grad():
        hidden = model.embed(x)
        for block in model.blocks:
            hidden = block(hidden)
        logits = model.head(hidden)
        assert torch.equal(model(x), logits)
        assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
        loss = model(x[:, :-1], x[:, 1:])
        expected = F.cross_entropy(model(x[:, :-1]).reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        assert torch.equal(loss, expected)
    with pytest.raises(ValueError, match=f"exceeds model.seq_len={cfg.seq_len}"):
        model(tokens(cfg, 1, cfg.seq_len + 1, 2))


@pytest.mark.parametrize("cfg", FAMILY_CONFIGS, ids=IDS)
def test_is_causal(cfg):
    model = built(cfg)
    x = tokens(cfg, 1, cfg.seq_len, 3)
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])


@pytest.mark.parametrize("cfg", [GPT2_UNTIED, LLAMA_GQA], ids=["gpt2", "llama"])
def test_build_is_seeded_and_leaves_global_rng_alone(cfg):
    state = torch.get_rng_state()
    a, b, c = families.build(cfg, 7), families.build(cfg, 7), families.build(cfg, 8)
    assert torch.equal(torch.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].dim() == 2)  # every drawn weight


@pytest.mark.parametrize("cfg", [GPT2_UNTIED, LLAMA_GQA], ids=["gpt2", "llama"])
def test_init(cfg):
    model = families.build(cfg, 0)
    for name, p in model.named_parameters():
        if p.dim() == 1 and name.endswith("weight"):
            assert torch.equal(p, torch.ones_like(p)), name  # LayerNorm / RMSNorm scale
        elif p.dim() == 1:
            assert torch.equal(p, torch.zeros_like(p)), name  # every bias
        else:
            assert abs(p.std().item() - 0.02) < 0.004 and abs(p.mean().item()) < 0.004, name


def test_minigpt_builds_through_families_with_the_same_weights():
    from distlib.app.model.minigpt import build_model

    cfg = ModelConfig()
    model, ref = families.build(cfg, 3), build_model(cfg, 3)
    assert type(model) is MiniGPT
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


# -- the config rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"mlp_hidden": 100},
            "model.mlp_hidden=100 does not apply to model.family=minigpt "
            "(used by gpt2, llama, qwen3, mixtral, qwen3_moe, deepseek_v3)",
        ),
        ({"tie_embeddings": True}, "model.tie_embeddings=True does not apply to model.family=minigpt"),
        (
            {"rope_theta": 500.0},
            "model.rope_theta=500.0 does not apply to model.family=minigpt "
            "(used by llama, qwen3, mixtral, qwen3_moe, deepseek_v3)",
        ),
        ({"norm_eps": 1e-6}, "model.norm_eps=1e-06 does not apply to model.family=minigpt"),
        ({"init_from": "x"}, "model.init_from='x' does not apply to model.family=minigpt"),
        (
            {"family": "gpt2", "n_kv_heads": 2},
            "model.n_kv_heads=2 does not apply to model.family=gpt2 "
            "(used by llama, qwen3, mixtral, qwen3_moe)",
        ),
        ({"family": "gpt2", "rope_theta": 1.0}, "model.rope_theta=1.0 does not apply to model.family=gpt2"),
        ({"family": "llama", "n_kv_heads": 3}, "model.n_heads=4 must be a multiple of model.n_kv_heads=3"),
        (
            {"family": "llama", "mlp_hidden": 10, "mlp_ratio": 2},
            "model.mlp_hidden=10 and model.mlp_ratio=2 both",
        ),
        (
            {"family": "bert"},
            "model.family must be one of ['minigpt', 'gpt2', 'llama', 'qwen3', 'mixtral', 'qwen3_moe', "
            "'deepseek_v3'], "
            "got 'bert'",
        ),
    ],
)
def test_a_key_that_does_not_fit_the_family_is_one_config_error(values, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"model": values})
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "cfg, tp, message",
    [
        (LLAMA_GQA, 4, "dist.tp=4 must divide model.n_kv_heads=2 (key/value heads are split"),
        (LLAMA_GQA, 3, "dist.tp=3 must divide model.n_heads=4 (attention heads"),
        (replace(GPT2_UNTIED, n_heads=3), 3, "dist.tp=3 must divide model.mlp_hidden=100 (MLP hidden units"),
        (replace(LLAMA_GQA, mlp_hidden=81), 2, "dist.tp=2 must divide model.mlp_hidden=81"),
        (replace(GPT2_TIED, dim=36, n_heads=6, mlp_ratio=1), 4, "dist.tp=4 must divide model.n_heads=6"),
    ],
)
def test_tensor_parallelism_refuses_a_dimension_that_does_not_split(cfg, tp, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        check_tensor_parallel(cfg, tp)
    assert "\n" not in str(err.value)
    tree = {"model": {k: v for k, v in cfg.to_dict().items()}, "dist": {"world_size": tp, "tp": tp}}
    with pytest.raises(ConfigError, match=re.escape(message)):
        RunConfig.from_dict(tree | {"train": {"global_batch": 16}})


@pytest.mark.parametrize(
    "cfg, tp",
    [
        (LLAMA_GQA, 2),
        (LLAMA_GQA, 1),
        (GPT2_UNTIED, 2),
        (replace(GPT2_UNTIED, mlp_hidden=96), 6),
        (GPT2_TIED, 4),
    ],
)
def test_tensor_parallelism_accepts_what_splits(cfg, tp):
    check_tensor_parallel(cfg, tp)


def test_tied_embeddings_with_a_pipeline_are_refused_with_what_to_set():
    tree = {
        "model": {"family": "llama", "tie_embeddings": True, "n_layers": 2},
        "dist": {"world_size": 2, "pp": 2},
    }
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(tree)
    assert str(err.value) == (
        "model.tie_embeddings=true is not supported with dist.pp=2: the first stage's embedding and the "
        "last stage's LM head would be one weight on two ranks; set model.tie_embeddings=false or dist.pp=1"
    )
    tree["model"]["tie_embeddings"] = False
    RunConfig.from_dict(tree)


# -- tensor parallelism ------------------------------------------------------------------------------


def _rank_copy(module: nn.Module, prefix: str, plan: dict, tp: int, rank: int) -> nn.Module:
    """What tensor-parallel rank ``rank`` holds of ``module`` (at ``prefix`` in the model): each planned
    Linear narrowed with shard_of; row-parallel layers lose their bias (added once, after the sum)."""
    module = copy.deepcopy(module)
    for path, sub in list(module.named_modules()):
        style = [s for pattern, s in plan.items() if _matches(f"{prefix}.{path}", pattern)]
        if not style:
            continue
        col = isinstance(style[0], Column)
        split = (
            Split(dim=0, parts=tp, index=rank, groups=style[0].groups)
            if col
            else Split(dim=1, parts=tp, index=rank)
        )
        weight = shard_of(sub.weight.detach(), split)
        narrow = nn.Linear(weight.shape[1], weight.shape[0], bias=col and sub.bias is not None)
        with torch.no_grad():
            narrow.weight.copy_(weight)
            if col and sub.bias is not None:
                narrow.bias.copy_(shard_of(sub.bias.detach(), split))
        parent, _, name = path.rpartition(".")
        setattr(module.get_submodule(parent), name, narrow)
    return module


def _row_bias(half: nn.Module) -> torch.Tensor | float:
    row = half.proj if hasattr(half, "proj") else (half.o_proj if hasattr(half, "o_proj") else half.down_proj)
    return row.bias if row.bias is not None else 0.0


def _emulated_block(block: nn.Module, index: int, plan: dict, tp: int, x: torch.Tensor) -> torch.Tensor:
    """The block as tp ranks compute it: each rank's attention (MLP) partial output from its narrowed
    layers, the partials summed in rank order (the all-reduce), the row-parallel bias added once."""
    attns = [_rank_copy(block.attn, f"blocks.{index}.attn", plan, tp, r) for r in range(tp)]
    mlps = [_rank_copy(block.mlp, f"blocks.{index}.mlp", plan, tp, r) for r in range(tp)]
    h = block.ln1(x)
    partial = attns[0](h)
    for attn in attns[1:]:
        partial = partial + attn(h)
    x = x + (partial + _row_bias(block.attn))
    h = block.ln2(x)
    partial = mlps[0](h)
    for mlp in mlps[1:]:
        partial = partial + mlp(h)
    return x + (partial + _row_bias(block.mlp))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("cfg", [LLAMA_GQA, GPT2_UNTIED], ids=["llama", "gpt2"])
def test_tensor_parallel_arithmetic_emulated(cfg, tp):
    check_tensor_parallel(cfg, tp)
    model = built(cfg)
    plan = families.tensor_parallel_plan(cfg)
    x = torch.randn(2, cfg.seq_len, cfg.dim, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model.blocks[0](x)
        split = _emulated_block(model.blocks[0], 0, plan, tp, x)
    assert max_diff(full, split) <= 1e-6
    if tp > 1:  # the ranks really computed different heads: one rank alone is not the block
        lone = _rank_copy(model.blocks[0].attn, "blocks.0.attn", plan, tp, 0)
        with torch.no_grad():
            h = model.blocks[0].ln1(x)
            assert max_diff(lone(h), model.blocks[0].attn(h)) > 1e-3


def _tp_rank(comm, cfgs):
    """On each of 2 gloo ranks: the whole model's logits and gradients, then the tensor-parallel model's."""
    out = []
    for cfg in cfgs:
        x = tokens(cfg, 2, cfg.seq_len, 9)
        ref = built(cfg)
        ref(x[:, :-1], x[:, 1:]).backward()
        model = built(cfg)
        splits = families.shard_model_(model, comm)
        logits = model(x)
        model(x[:, :-1], x[:, 1:]).backward()
        ref_params = dict(ref.named_parameters())
        grad_diff = max(
            max_diff(p.grad, shard_of(ref_params[n].grad, splits.get(n))) for n, p in model.named_parameters()
        )
        out.append((max_diff(logits, ref(x)), grad_diff, len(splits)))
    return out


def test_tensor_parallel_on_two_gloo_ranks():
    cfgs = [LLAMA_GQA, GPT2_UNTIED]
    for rank in run_ranks(_tp_rank, 2, cfgs, timeout_s=60):
        for (logit_diff, grad_diff, n_split), cfg in zip(rank, cfgs):
            assert n_split == cfg.n_layers * (7 if cfg.family == "llama" else 6)  # split weights and biases
            assert logit_diff <= 1e-6 and grad_diff <= 1e-6, (cfg.family, logit_diff, grad_diff)


# -- activation checkpointing ----------------------------------------------------------------------


def _step(cfg, seed):
    model = perturb_(families.build(cfg, 0), 1).train()
    x = tokens(cfg, 2, cfg.seq_len, 4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the dropout masks
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["gpt2-tied", "gpt2-untied", "llama-gqa", "llama-tied"])
def test_activation_checkpointing_is_bitwise_neutral(name, monkeypatch):
    cfg = replace(CONFIGS[name], dropout=0.1)
    block_cls = type(families.build(cfg, 0).blocks[0])
    calls = []
    original = block_cls._forward
    monkeypatch.setattr(block_cls, "_forward", lambda self, *a: calls.append(1) or original(self, *a))
    loss, grads = _step(replace(cfg, activation_checkpointing="none"), 11)
    plain_calls, calls[:] = len(calls), []
    ckpt_loss, ckpt_grads = _step(replace(cfg, activation_checkpointing="blocks"), 11)
    assert plain_calls == cfg.n_layers and len(calls) == 2 * cfg.n_layers  # recomputed in backward
    assert torch.equal(loss, ckpt_loss)
    assert grads.keys() == ckpt_grads.keys()
    assert [n for n in grads if not torch.equal(grads[n], ckpt_grads[n])] == []
    other_loss, _ = _step(replace(cfg, activation_checkpointing="blocks"), 12)
    assert not torch.equal(loss, other_loss)  # dropout is on: another seed draws other masks
