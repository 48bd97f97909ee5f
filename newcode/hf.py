"""Hugging Face checkpoints in and out: GPT-2 <-> GPT2LMHeadModel, Llama <-> LlamaForCausalLM.

Export: ``save_hf_dir(cfg, state_dict, dir)`` writes config.json, model.safetensors and
generation_config.json, which ``AutoModelForCausalLM.from_pretrained(dir)`` loads with no missing or
unexpected keys. Import: ``load_hf_dir(dir)`` (or ``from_hf(config, tensors)``) returns the
ModelConfig fields and our state_dict, refusing (``HFError``, one line) anything our models would
not compute exactly as transformers does. MiniGPT has no exact HF counterpart (``export_refusal``).

transformers is an optional dependency (the ``hf`` extra): it is imported inside the functions that
need it (the configs); the tensor renaming and the safetensors reading need only torch/safetensors.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from layers import ModelConfig, head_dim, kv_heads, mlp_width
import families

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
# The base model's prefix inside the *ForCausalLM checkpoints (a bare base-model checkpoint lacks it).
BASE_PREFIX = {"gpt2": "transformer.", "llama": "model."}
# Buffers old checkpoints carry and transformers itself ignores on load (not weights).
IGNORED = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$|\.rotary_emb\.inv_freq$")
MISSING_EXTRA = "this needs the optional `hf` extra: pip install transformers"


class HFError(ValueError):
    """A config or checkpoint that cannot be converted exactly, with the one-line reason."""


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError(MISSING_EXTRA) from exc
    return transformers


def export_refusal(cfg) -> str | None:
    """Why ``cfg`` cannot be written as a Hugging Face model, or None if it can."""
    if cfg.family == "minigpt":
        return ("MiniGPT has no exact Hugging Face equivalent: its LM head has a bias and its MLP uses the "
                "exact (erf) GELU, GPT-2's head has none and uses the tanh approximation; train "
                "model.family=gpt2 to export")
    if cfg.family not in ARCHITECTURES:
        return f"model.family={cfg.family!r} has no Hugging Face counterpart"
    return None


def _refuse_export(cfg) -> None:
    reason = export_refusal(cfg)
    if reason:
        raise HFError(reason)


# -- config ------------------------------------------------------------------------------------

def hf_config_object(cfg, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """transformers' GPT2Config / LlamaConfig for ``cfg``. Special tokens default to None: the
    project's byte-level tokenizer has none (HF's defaults, 50256 or 1/2, would be ordinary bytes or
    outside the vocabulary, and generate() would stop on them)."""
    _refuse_export(cfg)
    tf = _transformers()
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings,
                  bos_token_id=bos_token_id, eos_token_id=eos_token_id, initializer_range=0.02)
    if cfg.family == "gpt2":
        width = mlp_width(cfg)
        config = tf.GPT2Config(n_positions=cfg.seq_len, n_embd=cfg.dim, n_layer=cfg.n_layers,
                               n_head=cfg.n_heads, n_inner=None if width == 4 * cfg.dim else width,
                               activation_function="gelu_new", resid_pdrop=cfg.dropout,
                               embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                               layer_norm_epsilon=cfg.norm_eps, scale_attn_weights=True,
                               scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, **common)
    else:
        config = tf.LlamaConfig(hidden_size=cfg.dim, intermediate_size=mlp_width(cfg),
                                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                                num_key_value_heads=kv_heads(cfg), head_dim=head_dim(cfg), hidden_act="silu",
                                max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,
                                rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
                                attention_bias=False, attention_dropout=cfg.dropout, mlp_bias=False, **common)
    config.architectures = [ARCHITECTURES[cfg.family]]
    config.dtype = torch.float32
    return config


def hf_config(cfg, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """The config.json content: what save_pretrained writes, plus the keys transformers 4.x reads
    (``torch_dtype``; Llama's top-level ``rope_theta``), which transformers 5 accepts and ignores."""
    config = hf_config_object(cfg, bos_token_id, eos_token_id)
    legacy = {"torch_dtype": "float32"}
    if cfg.family == "llama":
        legacy["rope_theta"] = float(cfg.rope_theta)
    return config.to_diff_dict() | legacy


# -- tensor names --------------------------------------------------------------------------------

def _gpt2_names(cfg) -> list[tuple[str, str, bool]]:
    """(ours, HF's, transpose?) per tensor; HF's Conv1D holds every block Linear as (in, out)."""
    pairs = [("tok_emb.weight", "transformer.wte.weight", False),
             ("pos_emb.weight", "transformer.wpe.weight", False)]
    block = [("ln1", "ln_1", False), ("attn.qkv", "attn.c_attn", True), ("attn.proj", "attn.c_proj", True),
             ("ln2", "ln_2", False), ("mlp.fc", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True)]
    for i in range(cfg.n_layers):
        for ours, theirs, linear in block:
            pairs.append((f"blocks.{i}.{ours}.weight", f"transformer.h.{i}.{theirs}.weight", linear))
            pairs.append((f"blocks.{i}.{ours}.bias", f"transformer.h.{i}.{theirs}.bias", False))
    pairs += [("ln_f.weight", "transformer.ln_f.weight", False),
              ("ln_f.bias", "transformer.ln_f.bias", False)]
    return pairs + [("lm_head.weight", "lm_head.weight", False)]


def _llama_names(cfg) -> list[tuple[str, str, bool]]:
    pairs = [("tok_emb.weight", "model.embed_tokens.weight", False)]
    block = [("ln1", "input_layernorm"), ("attn.q_proj", "self_attn.q_proj"),
             ("attn.k_proj", "self_attn.k_proj"), ("attn.v_proj", "self_attn.v_proj"),
             ("attn.o_proj", "self_attn.o_proj"),
             ("ln2", "post_attention_layernorm"), ("mlp.gate_proj", "mlp.gate_proj"),
             ("mlp.up_proj", "mlp.up_proj"), ("mlp.down_proj", "mlp.down_proj")]
    for i in range(cfg.n_layers):
        pairs += [(f"blocks.{i}.{ours}.weight", f"model.layers.{i}.{theirs}.weight", False)
                  for ours, theirs in block]
    return pairs + [("ln_f.weight", "model.norm.weight", False), ("lm_head.weight", "lm_head.weight", False)]


def name_map(cfg) -> list[tuple[str, str, bool]]:
    """Our name, HF's name, whether the weight is transposed. A tied lm_head.weight is not listed:
    save_pretrained leaves it out and from_pretrained ties it to the embedding."""
    pairs = _gpt2_names(cfg) if cfg.family == "gpt2" else _llama_names(cfg)
    return [p for p in pairs if not (cfg.tie_embeddings and p[0] == "lm_head.weight")]


def _host_copy(t: torch.Tensor, transpose: bool) -> torch.Tensor:
    # A copy, not a view: parameters may be views into one flat buffer, which safetensors refuses
    # (shared memory), and Conv1D wants the transpose materialized.
    t = t.detach().to("cpu")
    return (t.t() if transpose else t).clone(memory_format=torch.contiguous_format)


def _check_ours(cfg, state_dict: dict) -> None:
    expected = families.param_shapes(cfg)
    names = set(state_dict) | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if names != set(expected):
        raise HFError(f"state_dict does not match the {cfg.family} config: "
                      f"missing {_brief(set(expected) - names)}, unexpected {_brief(names - set(expected))}")
    bad = [f"{k} {tuple(v.shape)} != {expected[k]}" for k, v in state_dict.items()
           if tuple(v.shape) != expected[k]]
    if bad:
        raise HFError(f"state_dict shapes do not match the {cfg.family} config: " + "; ".join(bad[:3]))


def to_hf_state_dict(cfg, state_dict: dict) -> dict[str, torch.Tensor]:
    """Our state_dict under HF's names and layouts (contiguous CPU copies), as save_pretrained saves it."""
    _refuse_export(cfg)
    _check_ours(cfg, state_dict)
    return {theirs: _host_copy(state_dict[ours], transpose) for ours, theirs, transpose in name_map(cfg)}


# -- import --------------------------------------------------------------------------------------

def _mlp_fields(hidden: int, dim: int) -> dict:
    """An MLP width as mlp_ratio when it is a multiple of dim, else as mlp_hidden."""
    if hidden % dim == 0:
        return {"mlp_ratio": hidden // dim, "mlp_hidden": None}
    return {"mlp_ratio": 4, "mlp_hidden": hidden}


def _refuse_if(condition: bool, reason: str) -> None:
    if condition:
        raise HFError(f"cannot convert exactly: {reason}")


def _gpt2_fields(c) -> dict:
    _refuse_if(c.activation_function != "gelu_new",
               f"activation_function={c.activation_function!r} (only 'gelu_new' is implemented)")
    _refuse_if(not c.scale_attn_weights,
               "scale_attn_weights=false (our scores are always scaled by head_dim**-0.5)")
    _refuse_if(c.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=true is not implemented")
    _refuse_if(c.reorder_and_upcast_attn, "reorder_and_upcast_attn=true is not implemented")
    _refuse_if(c.add_cross_attention, "add_cross_attention=true (our decoder has no cross-attention)")
    _refuse_if(c.n_embd % c.n_head != 0, f"n_embd={c.n_embd} is not a multiple of n_head={c.n_head}")
    drops = {"resid_pdrop": c.resid_pdrop, "embd_pdrop": c.embd_pdrop, "attn_pdrop": c.attn_pdrop}
    _refuse_if(len(set(drops.values())) > 1, f"dropouts differ {drops} (model.dropout is one probability)")
    hidden = c.n_inner if c.n_inner is not None else 4 * c.n_embd
    return dict(family="gpt2", vocab_size=c.vocab_size, seq_len=c.n_positions, dim=c.n_embd, n_heads=c.n_head,
                n_layers=c.n_layer, **_mlp_fields(hidden, c.n_embd), n_kv_heads=None,
                tie_embeddings=bool(c.tie_word_embeddings), norm_eps=float(c.layer_norm_epsilon),
                rope_theta=10000.0, dropout=float(c.resid_pdrop), activation_checkpointing="none")


def _llama_fields(c, raw: dict) -> dict:
    _refuse_if(c.hidden_act not in ("silu", "swish"),
               f"hidden_act={c.hidden_act!r} (only 'silu' is implemented)")
    _refuse_if(bool(c.attention_bias), "attention_bias=true (our projections have no bias)")
    _refuse_if(bool(c.mlp_bias), "mlp_bias=true (our MLP has no bias)")
    heads, dim = c.num_attention_heads, c.hidden_size
    _refuse_if(dim % heads != 0, f"hidden_size={dim} is not a multiple of num_attention_heads={heads}")
    _refuse_if(c.head_dim != dim // heads, f"head_dim={c.head_dim} is not hidden_size // num_attention_heads")
    kv = c.num_key_value_heads
    _refuse_if(heads % kv != 0, f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    scaling = raw.get("rope_scaling")
    _refuse_if(scaling is not None, f"rope_scaling={scaling!r} (only default RoPE, no scaling)")
    rope = dict(c.rope_parameters or {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)})
    _refuse_if(rope.get("rope_type", "default") != "default" or set(rope) - {"rope_type", "rope_theta"},
               f"rope_parameters={rope!r} (only default RoPE, no scaling)")
    return dict(family="llama", vocab_size=c.vocab_size, seq_len=c.max_position_embeddings, dim=dim,
                n_heads=heads, n_layers=c.num_hidden_layers, **_mlp_fields(c.intermediate_size, dim),
                n_kv_heads=None if kv == heads else kv, tie_embeddings=bool(c.tie_word_embeddings),
                norm_eps=float(c.rms_norm_eps), rope_theta=float(rope.get("rope_theta", 10000.0)),
                dropout=float(c.attention_dropout or 0.0), activation_checkpointing="none")


def config_fields(config_dict: dict) -> dict:
    """ModelConfig fields for an HF config.json, read through transformers' own config class (so
    absent keys take the defaults transformers would use); HFError for anything not exact."""
    model_type = config_dict.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HFError(f"model_type {model_type!r} is not supported (only 'gpt2' and 'llama' convert exactly)")
    tf = _transformers()
    cls = tf.GPT2Config if model_type == "gpt2" else tf.LlamaConfig
    try:
        config = cls.from_dict(dict(config_dict))
    except (TypeError, ValueError, KeyError) as exc:
        raise HFError(f"config.json is not a valid {model_type} config: {str(exc).splitlines()[0]}") from exc
    return _gpt2_fields(config) if model_type == "gpt2" else _llama_fields(config, config_dict)


def _canonical_names(family: str, names) -> dict[str, str]:
    """HF tensor name -> the name with the base prefix (a bare base-model checkpoint lacks it);
    ignored buffers dropped."""
    prefix = BASE_PREFIX[family]
    out = {}
    for name in names:
        if IGNORED.search(name):
            continue
        out[name] = name if name.startswith(prefix) or name == "lm_head.weight" else prefix + name
    return out


def _brief(names) -> str:
    names = sorted(names)
    return str(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


def _state_from_hf(cfg, hf_state: dict) -> dict[str, torch.Tensor]:
    canon = _canonical_names(cfg.family, hf_state)
    tensors = {c: hf_state[n] for n, c in canon.items()}
    pairs = name_map(cfg)
    expected = families.param_shapes(cfg)
    extra_head = cfg.tie_embeddings and "lm_head.weight" in tensors   # saved although tied: must be equal
    wanted = {theirs for _, theirs, _ in pairs} | ({"lm_head.weight"} if extra_head else set())
    missing, unexpected = wanted - set(tensors), set(tensors) - wanted
    if missing or unexpected:
        raise HFError(f"the checkpoint's tensors do not match its config.json: missing {_brief(missing)}, "
                      f"unexpected {_brief(unexpected)}")
    state = {}
    for ours, theirs, transpose in pairs:
        # fp32, as the trainer's master weights are (bf16/fp16 -> fp32 is exact)
        t = tensors[theirs].detach().to("cpu", torch.float32)
        t = (t.t() if transpose else t).contiguous()
        if tuple(t.shape) != expected[ours]:
            raise HFError(f"{theirs} has shape {tuple(tensors[theirs].shape)}, the config implies "
                          f"{expected[ours][::-1] if transpose else expected[ours]}")
        state[ours] = t
    if cfg.tie_embeddings:
        if extra_head and not torch.equal(tensors["lm_head.weight"].float(), state["tok_emb.weight"]):
            raise HFError("tie_word_embeddings is true but lm_head.weight differs from the token embedding")
        state["lm_head.weight"] = state["tok_emb.weight"]      # as our tied model's state_dict() lists it
    return {k: state[k] for k in expected}


def from_hf(config_dict: dict, hf_state_dict: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(ModelConfig fields, our state_dict) for an HF GPT-2 or Llama config and its tensors."""
    fields = config_fields(config_dict)
    return fields, _state_from_hf(ModelConfig(**fields), hf_state_dict)


# -- directories ---------------------------------------------------------------------------------

def save_hf_dir(cfg, state_dict: dict, out_dir, bos_token_id: int | None = None,
                eos_token_id: int | None = None) -> Path:
    """Write config.json, model.safetensors and generation_config.json into ``out_dir``."""
    from safetensors.torch import save_file
    config = hf_config_object(cfg, bos_token_id, eos_token_id)
    tensors = to_hf_state_dict(cfg, state_dict)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(cfg, bos_token_id, eos_token_id), indent=2,
                                                sort_keys=True) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _transformers().GenerationConfig.from_model_config(config).save_pretrained(str(out))
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
    except Exception as exc:   # noqa: BLE001 - safetensors raises its own error types
        raise HFError(f"cannot read {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
            from exc


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        return _read_safetensors(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise HFError(f"{path} has no model.safetensors or model.safetensors.index.json "
                      f"(only safetensors weights are read)")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise HFError(f"{index} has no weight_map")
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise HFError(f"{index} names {shard}, which is not in {path}")
        tensors.update(_read_safetensors(path / shard))
    if set(tensors) != set(weight_map):
        raise HFError(f"the shards in {path} hold other tensors than {index.name} lists: "
                      f"{_brief(set(tensors) ^ set(weight_map))}")
    return tensors


def load_hf_dir(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(ModelConfig fields, our state_dict) from a save_pretrained directory (safetensors, one file
    or sharded with model.safetensors.index.json)."""
    path = Path(path)
    if not path.is_dir():
        raise HFError(f"{path} is not a directory (expected a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise HFError(f"{path} has no config.json: not a Hugging Face model directory")
    return from_hf(_read_json(path / "config.json"), _read_weights(path))
