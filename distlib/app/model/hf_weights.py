"""Hugging Face weights both ways: our state_dict <-> GPT2LMHeadModel / LlamaForCausalLM /
Qwen3ForCausalLM / MixtralForCausalLM / Qwen3MoeForCausalLM's, and model directories (config.json,
model.safetensors, generation_config.json).

``save_hf_dir(cfg, state_dict, dir)`` writes a directory ``AutoModelForCausalLM.from_pretrained``
loads with no missing or unexpected keys; ``load_hf_dir(dir)`` returns the ModelConfig fields and
our state_dict of a ``save_pretrained`` directory (one safetensors file, or shards listed in
model.safetensors.index.json). A tied LM head is not written (save_pretrained leaves it out too;
from_pretrained ties it) and is accepted on import only if it equals the embedding.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from distlib.app.config.model_group import HEAD_NORMS, ModelConfig
from distlib.app.model import families, hf_deepseek
from distlib.app.model.bias_balance import state_names
from distlib.app.model.hf_config import (
    HFError,
    config_fields,
    hf_config,
    hf_config_object,
    transformers_module,
)

# The base model's prefix inside the *ForCausalLM checkpoints (a bare base-model checkpoint lacks it).
BASE_PREFIX = {
    "gpt2": "transformer.",
    "llama": "model.",
    "qwen3": "model.",
    "mixtral": "model.",
    "qwen3_moe": "model.",
    "deepseek_v3": "model.",
}
# Where an MoE family's files put the router and the experts, and what they call w1, w2, w3.
EXPERT_FILES = {
    "mixtral": ("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"}),
    "qwen3_moe": ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
    "deepseek_v3": hf_deepseek.EXPERT_FILES,
}
# Buffers old checkpoints carry and transformers itself ignores on load (not weights).
IGNORED = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$|\.rotary_emb\.inv_freq$")


def _gpt2_names(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(ours, transformers', transposed?) per tensor; Conv1D holds every block Linear as (in, out)."""
    pairs = [
        ("tok_emb.weight", "transformer.wte.weight", False),
        ("pos_emb.weight", "transformer.wpe.weight", False),
    ]
    block = [
        ("ln1", "ln_1", False),
        ("attn.qkv", "attn.c_attn", True),
        ("attn.proj", "attn.c_proj", True),
        ("ln2", "ln_2", False),
        ("mlp.fc", "mlp.c_fc", True),
        ("mlp.proj", "mlp.c_proj", True),
    ]
    for i in range(cfg.n_layers):
        for ours, theirs, linear in block:
            pairs.append((f"blocks.{i}.{ours}.weight", f"transformer.h.{i}.{theirs}.weight", linear))
            pairs.append((f"blocks.{i}.{ours}.bias", f"transformer.h.{i}.{theirs}.bias", False))
    pairs += [
        ("ln_f.weight", "transformer.ln_f.weight", False),
        ("ln_f.bias", "transformer.ln_f.bias", False),
    ]
    return pairs + [("lm_head.weight", "lm_head.weight", False)]


def _feed_forward_names(cfg: ModelConfig) -> list[tuple[str, str]]:
    if not cfg.has_experts:
        return [
            ("mlp.gate_proj", "mlp.gate_proj"),
            ("mlp.up_proj", "mlp.up_proj"),
            ("mlp.down_proj", "mlp.down_proj"),
        ]
    # The files name each expert (save_pretrained writes these names; transformers 5 fuses the
    # experts into gate_up_proj/down_proj tensors in memory, from_pretrained converts).
    where, called = EXPERT_FILES[cfg.family]
    experts = [
        (f"experts.{e}.{w}", f"experts.{e}.{called[w]}")
        for e in range(cfg.n_experts)
        for w in ("w1", "w2", "w3")
    ]
    return [(f"mlp.{ours}", f"{where}.{theirs}") for ours, theirs in [("gate", "gate"), *experts]]


def _llama_names(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """Llama's, Qwen3's (with the head norms), Mixtral's (the experts in place of the MLP) and
    Qwen3-MoE's (both)."""
    norms = [("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm")]
    block = [
        ("ln1", "input_layernorm"),
        ("attn.q_proj", "self_attn.q_proj"),
        ("attn.k_proj", "self_attn.k_proj"),
        ("attn.v_proj", "self_attn.v_proj"),
        ("attn.o_proj", "self_attn.o_proj"),
        *(norms if cfg.family in HEAD_NORMS else []),
        ("ln2", "post_attention_layernorm"),
        *_feed_forward_names(cfg),
    ]
    pairs = [("tok_emb.weight", "model.embed_tokens.weight", False)]
    for i in range(cfg.n_layers):
        pairs += [
            (f"blocks.{i}.{ours}.weight", f"model.layers.{i}.{theirs}.weight", False)
            for ours, theirs in block
        ]
    return pairs + [("ln_f.weight", "model.norm.weight", False), ("lm_head.weight", "lm_head.weight", False)]


def _deepseek_names(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    pairs = [("tok_emb.weight", "model.embed_tokens.weight", False)]
    for i in range(cfg.n_layers):
        pairs += [
            (f"blocks.{i}.{ours}.weight", f"model.layers.{i}.{theirs}.weight", False)
            for ours, theirs in hf_deepseek.block_names(cfg, i)
        ]
    return pairs + [("ln_f.weight", "model.norm.weight", False), ("lm_head.weight", "lm_head.weight", False)]


def name_map(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """Our name, transformers' name, whether the weight is transposed; a tied lm_head.weight is not
    listed (save_pretrained leaves it out, from_pretrained ties it to the embedding)."""
    names = {"gpt2": _gpt2_names, "deepseek_v3": _deepseek_names}
    pairs = names.get(cfg.family, _llama_names)(cfg)
    return [p for p in pairs if not (cfg.tie_embeddings and p[0] == "lm_head.weight")]


def _brief(names) -> str:
    names = sorted(names)
    return str(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


def _host_copy(t: torch.Tensor, transpose: bool) -> torch.Tensor:
    # A copy, not a view: parameters may be views into one flat buffer, which safetensors refuses
    # (shared memory), and Conv1D wants the transpose materialized.
    t = t.detach().to("cpu")
    return (t.t() if transpose else t).clone(memory_format=torch.contiguous_format)


def _check_ours(cfg: ModelConfig, state_dict: dict) -> None:
    expected = families.param_shapes(cfg)
    names = set(state_dict) | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    names -= set(state_names(cfg))  # (model.balance=bias: the selection biases, beside the weights)
    if names != set(expected):
        raise HFError(
            f"state_dict does not match the {cfg.family} config: missing "
            f"{_brief(set(expected) - names)}, unexpected {_brief(names - set(expected))}"
        )
    bad = [
        f"{k} {tuple(v.shape)} != {expected[k]}"
        for k, v in state_dict.items()
        if k in expected and tuple(v.shape) != expected[k]
    ]
    if bad:
        raise HFError(f"state_dict shapes do not match the {cfg.family} config: " + "; ".join(bad[:3]))


def to_hf_state_dict(cfg: ModelConfig, state_dict: dict) -> dict[str, torch.Tensor]:
    """Our state_dict (a tied lm_head.weight may be absent) under transformers' names and layouts,
    as contiguous CPU copies: what save_pretrained saves."""
    hf_config_object(cfg)  # refuses MiniGPT
    _check_ours(cfg, state_dict)
    out = {theirs: _host_copy(state_dict[ours], transpose) for ours, theirs, transpose in name_map(cfg)}
    return out | _correction_biases(cfg, state_dict)


def _correction_biases(cfg: ModelConfig, state_dict: dict) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's routers' e_score_correction_bias: the selection biases of model.balance=bias in
    ``state_dict`` (under their buffer names), else zeros (transformers' router always adds one)."""
    if cfg.family != "deepseek_v3":
        return {}
    zeros = torch.zeros(cfg.n_experts)
    return {
        theirs: _host_copy(state_dict.get(ours, zeros), False) for ours, theirs in hf_deepseek.bias_names(cfg)
    }


def _canonical_names(family: str, names) -> dict[str, str]:
    """transformers' name -> the name with the base prefix (a bare base-model checkpoint lacks it);
    ignored buffers dropped."""
    prefix = BASE_PREFIX[family]
    return {
        name: name if name.startswith(prefix) or name == "lm_head.weight" else prefix + name
        for name in names
        if not IGNORED.search(name)
    }


def state_from_hf(cfg: ModelConfig, hf_state: dict) -> dict[str, torch.Tensor]:
    """Our state_dict (fp32; a tied lm_head.weight is the embedding tensor) from transformers';
    DeepSeek-V3's with its routers' correction biases under the selection biases' names
    (``blocks.<b>.mlp.score_bias``)."""
    tensors = {c: hf_state[n] for n, c in _canonical_names(cfg.family, hf_state).items()}
    pairs, expected = name_map(cfg), families.param_shapes(cfg)
    extra_head = cfg.tie_embeddings and "lm_head.weight" in tensors  # saved although tied: must be equal
    wanted = {theirs for _, theirs, _ in pairs} | ({"lm_head.weight"} if extra_head else set())
    wanted |= {theirs for _, theirs in _bias_pairs(cfg)}
    missing, unexpected = wanted - set(tensors), set(tensors) - wanted
    if missing or unexpected:
        raise HFError(
            f"the checkpoint's tensors do not match its config.json: missing {_brief(missing)}, "
            f"unexpected {_brief(unexpected)}"
        )
    state = {}
    for ours, theirs, transpose in pairs:
        t = tensors[theirs].detach().to("cpu", torch.float32)  # as the master weights (exact from bf16)
        t = (t.t() if transpose else t).contiguous()
        if tuple(t.shape) != expected[ours]:
            raise HFError(
                f"{theirs} has shape {tuple(tensors[theirs].shape)}, the config implies "
                f"{expected[ours][::-1] if transpose else expected[ours]}"
            )
        state[ours] = t
    if cfg.tie_embeddings:
        if extra_head and not torch.equal(tensors["lm_head.weight"].float(), state["tok_emb.weight"]):
            raise HFError("tie_word_embeddings is true but lm_head.weight differs from the token embedding")
        state["lm_head.weight"] = state["tok_emb.weight"]  # as a tied model's state_dict() lists it
    return {k: state[k] for k in expected} | _biases_from_hf(cfg, tensors)


def _bias_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    return hf_deepseek.bias_names(cfg) if cfg.family == "deepseek_v3" else []


def _biases_from_hf(cfg: ModelConfig, tensors: dict) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's correction biases under our selection biases' names (float32)."""
    out = {}
    for ours, theirs in _bias_pairs(cfg):
        t = tensors[theirs].detach().to("cpu", torch.float32).contiguous()
        if tuple(t.shape) != (cfg.n_experts,):
            raise HFError(f"{theirs} has shape {tuple(t.shape)}, the config implies ({cfg.n_experts},)")
        out[ours] = t
    return out


def from_hf(config_dict: dict, hf_state_dict: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(ModelConfig fields, our state_dict) for a GPT-2, Llama, Qwen3 or Mixtral config.json and its
    tensors."""
    fields = config_fields(config_dict)
    return fields, state_from_hf(ModelConfig(**fields), hf_state_dict)


# -- directories ---------------------------------------------------------------------------------
def save_hf_dir(
    cfg: ModelConfig,
    state_dict: dict,
    out_dir,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> Path:
    """Write config.json, model.safetensors and generation_config.json into ``out_dir`` (made)."""
    from safetensors.torch import save_file

    config = hf_config_object(cfg, bos_token_id, eos_token_id)
    tensors = to_hf_state_dict(cfg, state_dict)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    content = hf_config(cfg, bos_token_id, eos_token_id)
    (out / "config.json").write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    transformers_module().GenerationConfig.from_model_config(config).save_pretrained(str(out))
    return out


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HFError(f"cannot read {path}: {exc}") from exc


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise HFError(f"cannot read {path}: {first}") from exc


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        return _read_safetensors(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise HFError(
            f"{path} has no model.safetensors or model.safetensors.index.json "
            f"(only safetensors weights are read)"
        )
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise HFError(f"{index} has no weight_map")
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise HFError(f"{index} names {shard}, which is not in {path}")
        tensors.update(_read_safetensors(path / shard))
    if set(tensors) != set(weight_map):
        raise HFError(
            f"the shards in {path} hold other tensors than {index.name} lists: "
            f"{_brief(set(tensors) ^ set(weight_map))}"
        )
    return tensors


def read_hf_config(path) -> dict:
    """The ModelConfig fields of the model directory ``path`` (its config.json only)."""
    path = Path(path)
    if not path.is_dir():
        raise HFError(f"{path} is not a directory (expected a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise HFError(f"{path} has no config.json: not a Hugging Face model directory")
    return config_fields(_read_json(path / "config.json"))


def load_hf_dir(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(ModelConfig fields, our state_dict) from a save_pretrained directory."""
    fields = read_hf_config(path)
    return fields, state_from_hf(ModelConfig(**fields), _read_weights(Path(path)))
