"""DeepSeek-V3 (``model.family=deepseek_v3``): the model against transformers' DeepseekV3ForCausalLM
(the loss, every gradient and the logits, with low-rank queries or one q_proj, dense first blocks,
shared experts, group-limited sigmoid routing with the correction biases; greedy generation), its
router against DeepSeek's rule written out here and against transformers' router, the Hugging Face
directory both ways (the biases included), and the refusals. Training at every layout:
tests/test_deepseek_v3_train.py. Offline (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from family_models import built, max_diff, quiet_transformers, tokens
from forkrun import run_script
from moe_against_hf import file_grads
from trainrun import compose_tree

from distlib.app.checkpointing import sampling
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.model import bias_balance, routers
from distlib.app.model import hf_config as hfc
from distlib.app.model import hf_weights as hfw

transformers = quiet_transformers()
TOL = 1e-5
# Low-rank queries, heads of 8 + 4 rotary with values of 6, a dense first block of another width,
# 8 experts in 4 groups (2 chosen), 2 shared experts, weights x 2.5, the selection biases on.
LOW_RANK = ModelConfig(
    family="deepseek_v3",
    vocab_size=64,
    seq_len=16,
    dim=32,
    n_heads=4,
    n_layers=3,
    mlp_hidden=24,
    dense_mlp_hidden=40,
    n_experts=8,
    top_k=2,
    n_group=4,
    topk_group=2,
    q_lora_rank=12,
    qk_rope_head_dim=4,
    v_head_dim=6,
    n_shared_experts=2,
    routed_scaling_factor=2.5,
    balance="bias",
    norm_eps=1e-6,
    rope_theta=500.0,
)
# One q_proj, every block MoE, a tied head, 3 of 4 experts weighed by their raw scores, no aux term
# (transformers' model has none)
FULL_QUERY = ModelConfig(
    family="deepseek_v3",
    vocab_size=50,
    seq_len=12,
    dim=24,
    n_heads=2,
    n_layers=2,
    n_experts=4,
    top_k=3,
    norm_topk_prob=False,
    first_k_dense_replace=0,
    tie_embeddings=True,
    router_aux_loss_coef=0.0,
)
CONFIGS = {"low-rank-biased": LOW_RANK, "full-query-tied": FULL_QUERY}


def _ours(cfg: ModelConfig, seed: int = 3):
    """Our model in training mode; with the selection biases, set to seeded non-zero values."""
    ours = built(cfg, seed=seed).train()
    gen = torch.Generator().manual_seed(seed)
    for bias in bias_balance.state_buffers(ours).values():
        bias.copy_(torch.randn(bias.shape, generator=gen) * 0.05)
    return ours


def _theirs(cfg: ModelConfig, ours, out_dir: Path):
    """transformers' eager model from our exported directory (the biases as its correction biases)."""
    hfw.save_hf_dir(cfg, ours.state_dict() | bias_balance.state_buffers(ours), out_dir)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir, output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    return theirs.train()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_gradients_and_logits_match_transformers(name, tmp_path):
    cfg = CONFIGS[name]
    ours = _ours(cfg)
    theirs = _theirs(cfg, ours, tmp_path / "hf")
    window = tokens(cfg, 3, cfg.seq_len + 1, 21)
    x, y = window[:, :-1], window[:, 1:].contiguous()
    loss = ours(x, y)
    out = theirs(input_ids=x, labels=y, shift_labels=y)
    assert abs(loss.item() - out.loss.item()) <= TOL
    loss.backward()
    out.loss.backward()
    grads = hfw.to_hf_state_dict(cfg, {n: p.grad for n, p in ours.named_parameters()})
    theirs_grads = file_grads(theirs, cfg)
    grads = {n: g for n, g in grads.items() if not n.endswith("e_score_correction_bias")}  # (buffers)
    assert grads.keys() == theirs_grads.keys()
    assert max(max_diff(grads[n], theirs_grads[n]) for n in grads) <= TOL
    with torch.no_grad():
        for seq in (cfg.seq_len, 5):
            assert max_diff(ours(x[:, :seq]), theirs(x[:, :seq]).logits) <= TOL


def test_greedy_generation_matches_transformers(tmp_path):
    """sampling.generate at temperature 0 (the whole context every token) gives the tokens
    transformers' greedy generate() gives (its cache of compressed latents, the correction biases)."""
    ours = _ours(LOW_RANK).eval()
    theirs = _theirs(LOW_RANK, ours, tmp_path / "hf").eval()
    prompt = tokens(LOW_RANK, 1, 5, 31)
    expected = sampling.generate(ours, prompt[0].tolist(), 10, temperature=0)
    out = theirs.generate(prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert out[0].tolist() == expected


def _rule(logits, bias, n_group: int, topk_group: int, top_k: int, normalise: bool, scale: float):
    """DeepSeek-V3's routing, token by token: (each token's expert ids, sorted; their weights)."""
    chosen = []
    for row, b in zip(logits.sigmoid().tolist(), [bias.tolist()] * len(logits)):
        choice = [s + c for s, c in zip(row, b)]
        size = len(row) // n_group
        groups = [sorted(choice[g * size : (g + 1) * size], reverse=True) for g in range(n_group)]
        best = sorted(range(n_group), key=lambda g: -(groups[g][0] + groups[g][1]))[:topk_group]
        allowed = [e for e in range(len(row)) if e // size in best]
        ids = sorted(sorted(allowed, key=lambda e: -choice[e])[:top_k])
        weights = [row[e] for e in ids]
        total = sum(weights) if normalise else 1.0
        chosen.append((ids, [w / total * scale for w in weights]))
    return chosen


@pytest.mark.parametrize("normalise", [True, False])
def test_the_router_chooses_in_groups_with_the_biases_and_weighs_without_them(normalise):
    router = routers.SigmoidGroupTopK(top_k=3, n_group=4, topk_group=2, normalise=normalise, scale=2.5)
    gen = torch.Generator().manual_seed(7)
    logits, bias = torch.randn(40, 12, generator=gen), torch.randn(12, generator=gen) * 0.3
    routed = router.route(logits, bias)
    order = routed.ids.argsort(dim=-1)
    ids, weights = routed.ids.gather(1, order), routed.weights.gather(1, order)
    for t, (want_ids, want_weights) in enumerate(_rule(logits, bias, 4, 2, 3, normalise, 2.5)):
        assert ids[t].tolist() == want_ids
        assert weights[t].tolist() == pytest.approx(want_weights, rel=1e-6)
    assert not torch.equal(router.route(logits, None).ids.sort().values, routed.ids.sort().values)
    scores = logits.sigmoid()
    assert torch.allclose(routed.probs, scores / scores.sum(dim=-1, keepdim=True))


def test_the_router_is_transformers_router():
    cfg = LOW_RANK
    ours = _ours(cfg)
    moe_layer = ours.blocks[1].mlp
    config = hfc.hf_config_object(cfg)
    theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        theirs.weight.copy_(moe_layer.gate.weight)
        theirs.e_score_correction_bias.copy_(moe_layer.score_bias)
    x = torch.randn(30, cfg.dim, generator=torch.Generator().manual_seed(2))
    ids, weights, _ = moe_layer.route(x)
    _, their_weights, their_ids = theirs(x)
    order, their_order = ids.argsort(dim=-1), their_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), their_ids.gather(1, their_order))
    assert max_diff(weights.gather(1, order), their_weights.gather(1, their_order)) <= 1e-7


def test_the_hugging_face_directory_both_ways(tmp_path):
    """Export: DeepseekV3's config.json and file names (the latent projections, the dense block's
    MLP, mlp.experts.{e}.gate_proj/up_proj/down_proj, shared_experts, the correction biases);
    import: our directory back to the same config, weights and biases, and a directory transformers'
    save_pretrained wrote to the same."""
    cfg = LOW_RANK
    ours = _ours(cfg)
    theirs = _theirs(cfg, ours, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    keys = ["model_type", "n_routed_experts", "n_group", "topk_group", "first_k_dense_replace", "q_lora_rank"]
    assert [config[k] for k in keys] == ["deepseek_v3", 8, 4, 2, 1, 12]
    names = {theirs for _, theirs, _ in hfw.name_map(cfg)}
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    layer = "model.layers.2."
    assert {layer + "self_attn.kv_a_proj_with_mqa.weight", layer + "self_attn.q_a_layernorm.weight"} <= names
    assert {f"{layer}mlp.experts.7.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")} <= names
    assert layer + "mlp.shared_experts.down_proj.weight" in names
    mine = ours.state_dict() | bias_balance.state_buffers(ours)
    theirs.save_pretrained(tmp_path / "theirs")
    for directory in (tmp_path / "ours", tmp_path / "theirs"):
        fields, state = hfw.load_hf_dir(directory)
        assert ModelConfig(**fields) == replace(cfg, balance="aux")  # (balancing is the run's choice)
        assert state.keys() == mine.keys() and all(torch.equal(state[k], mine[k]) for k in mine)
    biases = [state[n] for n in bias_balance.state_names(cfg)]
    assert len(biases) == 2 and all(b.any() for b in biases)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 with num_attention_heads=4"),
        ({"rope_interleave": False}, "rope_interleave=false"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling="),
    ],
)
def test_import_refuses_what_it_does_not_compute(change, message):
    with pytest.raises(hfc.HFError) as err:
        hfc.config_fields(hfc.hf_config(LOW_RANK) | change)
    assert str(err.value).startswith(f"cannot convert exactly: {message}")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.topk_group=5"], "model.topk_group=5 exceeds model.n_group=4"),
        (["model.n_group=3"], "model.n_group=3 must divide model.n_experts=8 into groups of at least 2"),
        (["model.n_group=8", "model.topk_group=1"], "model.n_group=8 must divide model.n_experts=8 into"),
        (["model.top_k=5"], "model.top_k=5 exceeds the 4 experts of model.topk_group=2 groups of 2"),
        (["model.first_k_dense_replace=2"], "model.first_k_dense_replace=2 leaves no MoE block"),
        (["model.qk_rope_head_dim=5"], "model.qk_rope_head_dim=5 must be even"),
        (["model.n_kv_heads=2"], "model.n_kv_heads=2 does not apply to model.family=deepseek_v3"),
        (["model=llama", "model.q_lora_rank=8"], "model.q_lora_rank=8 does not apply to model.family=llama"),
        (
            ["dist.world_size=3", "dist.ep=3", "train.global_batch=15"],
            "dist.ep=3 must divide model.n_experts",
        ),
        (
            ["dist.world_size=2", "dist.tp=2", "model.dense_mlp_hidden=33"],
            "invalid parallel layout: dist.tp=2",
        ),
    ],
)
def test_bad_input_is_one_config_error(overrides, message):
    preset = [] if overrides[0].startswith("model=") else ["model=deepseek_v3"]
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(compose_tree([*preset, *overrides]))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_train_py_refuses_before_any_worker(tmp_path):
    run = tmp_path / "refused"
    proc = run_script("train.py", "model=deepseek_v3_tiny", "model.topk_group=6", f"hydra.run.dir={run}")
    assert proc.returncode == 2 and not run.exists()
    assert proc.stderr.splitlines() == ["config error: model.topk_group=6 exceeds model.n_group=4"]
