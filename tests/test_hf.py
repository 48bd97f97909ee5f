"""GPT-2 and Llama against transformers' own forward, loss, gradients, dropout and generation, and
the Hugging Face conversion both ways (config.json and weights; refusals). Offline: every
transformers model here is made from a small config (HF_HUB_OFFLINE=1, tests/conftest.py)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch
from family_models import (
    CONFIGS,
    GPT2_TIED,
    GPT2_UNTIED,
    LLAMA_GQA,
    built,
    canonical,
    max_diff,
    perturb_,
    quiet_transformers,
    tokens,
)

from distlib.app.checkpointing import sampling
from distlib.app.config.model_group import ModelConfig
from distlib.app.model import families
from distlib.app.model import hf_config as hfc
from distlib.app.model import hf_weights as hfw

transformers = quiet_transformers()
TOL = 1e-5
IDS = list(CONFIGS)


def hf_model(cfg, state, attn="eager"):
    """transformers' model for cfg, built from our config.json, holding our converted weights."""
    config = transformers.AutoConfig.for_model(**hfc.hf_config(cfg))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    result = model.load_state_dict(hfw.to_hf_state_dict(cfg, state), strict=False)
    # a tied head is not saved (save_pretrained leaves it out too); it is the embedding itself
    assert result.missing_keys == (["lm_head.weight"] if cfg.tie_embeddings else [])
    assert not result.unexpected_keys
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == cfg.tie_embeddings
    assert model.config._attn_implementation == attn
    return model.eval()


@pytest.fixture(scope="module")
def pairs():
    """(ours, eager HF, sdpa HF) per config: ours perturbed so every bias and norm weight matters."""
    out = {}
    for name, cfg in CONFIGS.items():
        ours = built(cfg, seed=len(out))
        out[name] = (ours, hf_model(cfg, ours.state_dict()), hf_model(cfg, ours.state_dict(), "sdpa"))
    return out


@pytest.mark.parametrize("name", IDS)
def test_logits_match_transformers(pairs, name):
    ours, eager, sdpa = pairs[name]
    cfg = ours.cfg
    for seq in (cfg.seq_len, 5):
        x = tokens(cfg, 3, seq, seq)
        with torch.no_grad():
            logits = ours(x)
            assert max_diff(logits, eager(x).logits) <= TOL
            assert max_diff(logits, sdpa(x).logits) <= TOL


@pytest.mark.parametrize("cast", ["fp32", "bf16-params", "bf16-module"])
@pytest.mark.parametrize("name", IDS)
def test_bitwise_equal_to_transformers_eager_on_cpu(name, cast):
    """Op for op what transformers' eager path computes, so on this CPU the logits are the same
    bits, in fp32 and in bf16 (where any dtype detail -- RMSNorm's upcast, Llama's float32 softmax,
    RoPE's cast, the GELU formula -- moves bf16 logits by ~1e-2, far past what the 1e-5 fp32 tests
    see). bf16-params is the trainer's way (parameters cast, buffers kept); bf16-module is
    module.to(bf16) on both sides. Another CPU's kernels may round differently: the portable
    contract is the 1e-5 tests above."""
    cfg = CONFIGS[name]
    ours = built(cfg)
    theirs = hf_model(cfg, ours.state_dict())
    if cast == "bf16-params":
        for p in list(ours.parameters()) + list(theirs.parameters()):
            p.data = p.data.to(torch.bfloat16)
    elif cast == "bf16-module":
        ours.to(torch.bfloat16)
        theirs.to(torch.bfloat16)
    x = tokens(cfg, 2, cfg.seq_len, 13)
    with torch.no_grad():
        logits, expected = ours(x), theirs(x).logits
    assert logits.dtype == expected.dtype == (torch.float32 if cast == "fp32" else torch.bfloat16)
    assert torch.equal(logits, expected), max_diff(logits, expected)


@pytest.mark.parametrize("name", IDS)
def test_loss_and_gradients_match_transformers(pairs, name):
    ours, eager, _ = pairs[name]
    cfg = ours.cfg
    window = tokens(cfg, 2, cfg.seq_len, 21)
    ours.zero_grad(set_to_none=True)
    eager.zero_grad(set_to_none=True)
    loss = ours(window[:, :-1], window[:, 1:])
    theirs = eager(window, labels=window).loss  # transformers shifts the labels itself
    assert abs(loss.item() - theirs.item()) <= TOL
    loss.backward()
    theirs.backward()
    grads = hfw.to_hf_state_dict(cfg, {n: p.grad for n, p in ours.named_parameters()})
    hf_grads = {n: p.grad for n, p in eager.named_parameters()}
    assert grads.keys() == hf_grads.keys()
    assert max(max_diff(grads[n], hf_grads[n]) for n in grads) <= TOL


@pytest.mark.parametrize("name", IDS)
def test_greedy_generation_matches_transformers(pairs, name):
    """sampling.generate at temperature 0 (the whole context every token, no cache) gives the tokens
    transformers' cached greedy generate() gives."""
    ours, eager, sdpa = pairs[name]
    prompt = tokens(ours.cfg, 1, 5, 31)
    expected = sampling.generate(ours, prompt[0].tolist(), 10, temperature=0)
    for model in (eager, sdpa):
        out = model.generate(
            prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt)
        )
        assert out[0].tolist() == expected


@pytest.mark.parametrize("cfg", [GPT2_UNTIED, LLAMA_GQA], ids=["gpt2", "llama"])
def test_dropout_falls_where_transformers_puts_it(cfg):
    """Training mode, same RNG state: the dropout masks are drawn in transformers' order on its tensors."""
    cfg = replace(cfg, dropout=0.2)
    ours = built(cfg).train()
    theirs = hf_model(cfg, ours.state_dict()).train()
    x = tokens(cfg, 2, cfg.seq_len, 41)
    results = []
    for model in (ours, theirs):
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(5)
            out = model(x)
            results.append(out if isinstance(out, torch.Tensor) else out.logits)
    assert max_diff(results[0], results[1]) <= TOL
    with torch.no_grad():
        assert max_diff(results[0], ours.eval()(x)) > 1e-3  # dropout did something


@pytest.mark.parametrize("name", IDS)
def test_save_hf_dir_loads_with_from_pretrained(pairs, name, tmp_path):
    ours = pairs[name][0]
    cfg = ours.cfg
    hfw.save_hf_dir(cfg, ours.state_dict(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [hfc.ARCHITECTURES[cfg.family]] and config["torch_dtype"] == "float32"
    for attn in ("eager", None):  # None: transformers' default (sdpa)
        kwargs = {"attn_implementation": attn} if attn else {}
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, output_loading_info=True, **kwargs
        )
        problems = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
        assert not any(info.get(k) for k in problems), info
        assert all(p.dtype == torch.float32 for p in model.parameters())
        x = tokens(cfg, 2, cfg.seq_len, 51)
        with torch.no_grad():
            assert max_diff(ours(x), model.eval()(x).logits) <= TOL
    # and back: the same config and the same bytes
    fields, state = hfw.load_hf_dir(tmp_path)
    assert ModelConfig(**fields) == canonical(cfg)
    mine = ours.state_dict()
    assert state.keys() == mine.keys() and all(torch.equal(state[k], mine[k]) for k in mine)


def test_hf_config_fields():
    llama = hfc.hf_config(LLAMA_GQA)
    got = [llama[k] for k in ("model_type", "num_key_value_heads", "intermediate_size", "head_dim")]
    got += [llama[k] for k in ("max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")]
    assert got == ["llama", 2, 80, 8, 16, 1e-6, False]
    assert llama["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0}
    assert llama["bos_token_id"] is None and llama["eos_token_id"] is None
    gpt2 = hfc.hf_config(replace(GPT2_TIED, dropout=0.1))
    keys = ("model_type", "n_positions", "n_embd", "n_inner", "activation_function", "resid_pdrop")
    keys += ("embd_pdrop", "attn_pdrop", "tie_word_embeddings")
    assert [gpt2[k] for k in keys] == ["gpt2", 16, 32, None, "gelu_new", 0.1, 0.1, 0.1, True]
    assert hfc.hf_config(GPT2_UNTIED)["n_inner"] == 100
    assert hfc.hf_config(GPT2_TIED, eos_token_id=0)["eos_token_id"] == 0


@pytest.mark.parametrize(
    "cfg", list(CONFIGS.values()) + [replace(GPT2_UNTIED, dropout=0.1), replace(LLAMA_GQA, dropout=0.1)]
)
def test_config_round_trips_through_config_json(cfg):
    assert ModelConfig(**hfc.config_fields(hfc.hf_config(cfg))) == canonical(cfg)


# -- import ---------------------------------------------------------------------------------------------


def hf_small(family: str, tie: bool, seed: int):
    """A seeded transformers model from a small config of its own, its weights perturbed."""
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=60, n_positions=20, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=tie,
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        cls = transformers.GPT2LMHeadModel
    elif family == "qwen3":  # its heads 12 wide, not hidden_size / heads = 8; two key/value heads
        config = transformers.Qwen3Config(
            vocab_size=60, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, head_dim=12, max_position_embeddings=20, rms_norm_eps=1e-6,
            tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.LlamaConfig(
            vocab_size=60, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=20, rope_theta=2000.0, tie_word_embeddings=tie,
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        cls = transformers.LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return perturb_(model, seed).eval()


def _ours_from(fields, state):
    model = families.build(ModelConfig(**fields), 0)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize(
    "family, tie",
    [("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False), ("qwen3", True), ("qwen3", False)],
)
def test_import_save_pretrained(family, tie, tmp_path):
    theirs = hf_small(family, tie, seed=3)
    theirs.save_pretrained(tmp_path)
    fields, state = hfw.load_hf_dir(tmp_path)
    assert fields["family"] == family and fields["tie_embeddings"] == tie
    ours = _ours_from(fields, state)
    x = tokens(ours.cfg, 2, ours.cfg.seq_len, 61)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x).logits) <= TOL
        assert abs(ours(x[:, :-1], x[:, 1:]).item() - theirs(x, labels=x).loss.item()) <= TOL


def test_import_sharded_checkpoint(tmp_path):
    theirs = hf_small("llama", False, seed=4)
    theirs.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = _ours_from(*hfw.load_hf_dir(tmp_path))
    x = tokens(ours.cfg, 1, 12, 71)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x).logits) <= TOL
    (sorted(tmp_path.glob("model-*.safetensors"))[0]).unlink()
    with pytest.raises(hfc.HFError, match="names model-.* which is not in"):
        hfw.load_hf_dir(tmp_path)


def test_import_gpt2_base_model_names_and_old_buffers():
    """A bare GPT2Model checkpoint (no `transformer.` prefix, old attn.bias buffers, no head: tied)."""
    theirs = hf_small("gpt2", True, seed=5)
    tensors = {
        k.removeprefix("transformer."): v for k, v in theirs.state_dict().items() if k != "lm_head.weight"
    }
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 20, 20)
    ours = _ours_from(*hfw.from_hf(theirs.config.to_dict(), tensors))
    x = tokens(ours.cfg, 1, 20, 81)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x).logits) <= TOL


def _refusal(config_change=None, drop=None, add=None, reshape=None, family="llama", tie=False) -> str:
    theirs = hf_small(family, tie, seed=6)
    config = theirs.config.to_dict() | (config_change or {})
    tensors = dict(theirs.state_dict())
    if tie:
        tensors.pop("lm_head.weight")
    if drop:
        tensors.pop(drop)
    if add:
        tensors[add] = torch.zeros(3)
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    with pytest.raises(hfc.HFError) as err:
        hfw.from_hf(config, tensors)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling="),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
            "only default RoPE",
        ),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        # heads wider than the weights': the config is read, the weights refuse it
        ({"head_dim": 16}, "q_proj.weight has shape (48, 48), the config implies (96, 48)"),
    ],
)
def test_import_refuses_llama_configs(change, message):
    assert message in _refusal(change)


def test_import_refuses_a_qwen3_sliding_window():
    config = hfc.hf_config(CONFIGS["qwen3-gqa"]) | {"use_sliding_window": True, "sliding_window": 8}
    with pytest.raises(hfc.HFError) as err:
        hfc.config_fields(config)
    assert str(err.value) == (
        "cannot convert exactly: use_sliding_window=true (our attention sees every token)"
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"activation_function": "relu"}, "activation_function='relu'"),
        ({"activation_function": "gelu_pytorch_tanh"}, "only 'gelu_new'"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true"),
        ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=true"),
        ({"scale_attn_weights": False}, "scale_attn_weights=false"),
        ({"attn_pdrop": 0.3}, "dropouts differ"),
    ],
)
def test_import_refuses_gpt2_configs(change, message):
    assert message in _refusal(change, family="gpt2", tie=True)


def test_import_refuses_tensor_mismatches():
    layer = "model.layers.0."
    assert "missing ['model.layers.1.mlp.up_proj.weight']" in _refusal(
        drop="model.layers.1.mlp.up_proj.weight"
    )
    assert f"unexpected ['{layer}self_attn.q_proj.bias']" in _refusal(add=layer + "self_attn.q_proj.bias")
    assert f"{layer}self_attn.k_proj.weight has shape" in _refusal(reshape=layer + "self_attn.k_proj.weight")
    assert "missing ['lm_head.weight']" in _refusal(drop="lm_head.weight")  # untied: the head is needed
    gpt2 = _refusal(drop="transformer.h.0.attn.c_attn.bias", family="gpt2", tie=True)
    assert "missing ['transformer.h.0.attn.c_attn.bias']" in gpt2


def test_import_refuses_a_tied_head_that_differs():
    theirs = hf_small("llama", True, seed=7)
    tensors = {k: v.clone() for k, v in theirs.state_dict().items()}
    head = tensors["lm_head.weight"]
    tensors["lm_head.weight"] = head + 1.0
    with pytest.raises(hfc.HFError, match="lm_head.weight differs from the token embedding"):
        hfw.from_hf(theirs.config.to_dict(), tensors)
    tensors["lm_head.weight"] = head  # saved although tied, and equal: accepted
    hfw.from_hf(theirs.config.to_dict(), tensors)


def test_load_hf_dir_errors(tmp_path):
    with pytest.raises(hfc.HFError, match="is not a directory"):
        hfw.load_hf_dir(tmp_path / "nope")
    with pytest.raises(hfc.HFError, match="has no config.json"):
        hfw.load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(hfc.HFError, match="cannot read .*config.json"):
        hfw.load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hfc.hf_config(GPT2_TIED)))
    with pytest.raises(hfc.HFError, match="has no model.safetensors or model.safetensors.index.json"):
        hfw.load_hf_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(hfc.HFError, match="cannot read .*model.safetensors"):
        hfw.load_hf_dir(tmp_path)


# -- export refusals, the optional dependency ---------------------------------------------------------


def test_minigpt_export_is_refused(tmp_path):
    cfg = ModelConfig()
    reason = hfc.export_refusal(cfg)
    assert reason and "\n" not in reason and "LM head has a bias" in reason
    assert hfc.export_refusal(GPT2_TIED) is None and hfc.export_refusal(LLAMA_GQA) is None
    with pytest.raises(hfc.HFError, match="MiniGPT has no exact"):
        hfw.save_hf_dir(cfg, families.build(cfg, 0).state_dict(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_checks_our_state_dict():
    state = families.build(GPT2_UNTIED, 0).state_dict()
    state.pop("blocks.1.ln2.bias")
    with pytest.raises(hfc.HFError, match=r"missing \['blocks.1.ln2.bias'\]"):
        hfw.to_hf_state_dict(GPT2_UNTIED, state)
    tied = families.build(GPT2_TIED, 0).state_dict()
    tied.pop("lm_head.weight")  # a tied head may be left out (it is the embedding)
    assert "lm_head.weight" not in hfw.to_hf_state_dict(GPT2_TIED, tied)


def test_without_transformers_the_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(hfc.HFError, match=r"optional `hf` extra"):
        hfc.hf_config(GPT2_TIED)
    with pytest.raises(hfc.HFError, match=r"optional `hf` extra"):
        hfw.from_hf({"model_type": "gpt2"}, {})
