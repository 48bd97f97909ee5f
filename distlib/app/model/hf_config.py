"""Hugging Face model configs both ways: GPT-2 <-> GPT2Config, Llama <-> LlamaConfig, Qwen3 <->
Qwen3Config, Mixtral <-> MixtralConfig, Qwen3-MoE <-> Qwen3MoeConfig, DeepSeek-V3 <->
DeepseekV3Config (``hf_deepseek``).

Export: ``hf_config(cfg)`` is the config.json of a model directory that transformers'
``AutoModelForCausalLM.from_pretrained`` loads as the same model. Import: ``config_fields(config)``
reads a config.json through transformers' own config class (so absent keys take the defaults
transformers would use) and returns our ModelConfig fields, refusing (``HFError``, one line)
anything our models would not compute exactly as transformers does. MiniGPT has no exact
counterpart (``export_refusal``).

transformers is an optional dependency (the ``hf`` extra), imported inside the functions that
need it; without it they raise one line that names the extra.
"""

from __future__ import annotations

import torch

from distlib.app.config.model_group import DEEPSEEK_KEYS, HEAD_NORMS, ROPE, ModelConfig
from distlib.app.config.schema import defaults
from distlib.app.model import hf_deepseek
from distlib.app.model.hf_common import HFError, refuse_if, rope_theta, transformers_module

ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
CONFIG_CLASSES = {
    "gpt2": "GPT2Config",
    "llama": "LlamaConfig",
    "qwen3": "Qwen3Config",
    "mixtral": "MixtralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "deepseek_v3": "DeepseekV3Config",
}


def export_refusal(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot be written as a Hugging Face model, or None if it can."""
    if cfg.family == "minigpt":
        return (
            "MiniGPT has no exact Hugging Face equivalent: its LM head has a bias, its MLP uses the exact "
            "(erf) GELU and its scores are divided by sqrt(head_dim); GPT-2's head has no bias, uses the "
            "tanh approximation and multiplies by head_dim**-0.5; train model.family=gpt2 to export"
        )
    if cfg.has_experts and cfg.balance == "bias" and cfg.family != "deepseek_v3":
        return (
            f"model.balance=bias chooses the experts with biases that transformers' {cfg.family} router "
            f"does not have: the exported model would send tokens to other experts"
        )
    return None


def hf_config_object(cfg: ModelConfig, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """transformers' config object of ``cfg``'s family (``CONFIG_CLASSES``). Special
    tokens default to None: the byte-level tokenizer has none (transformers' defaults, 50256 or 1/2,
    would be outside a small vocabulary or ordinary bytes that generate() would stop on)."""
    reason = export_refusal(cfg)
    if reason:
        raise HFError(reason)
    tf = transformers_module()
    common = dict(
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        initializer_range=0.02,
    )
    if cfg.family == "deepseek_v3":  # its router's correction biases are the selection biases
        config = hf_deepseek.config(tf, cfg, common)
    elif cfg.family == "gpt2":
        config = tf.GPT2Config(
            n_positions=cfg.seq_len,
            n_embd=cfg.dim,
            n_layer=cfg.n_layers,
            n_head=cfg.n_heads,
            n_inner=None if cfg.mlp_width == 4 * cfg.dim else cfg.mlp_width,
            activation_function="gelu_new",
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            layer_norm_epsilon=cfg.norm_eps,
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False,
            **common,
        )
    else:
        common.update(
            hidden_size=cfg.dim,
            intermediate_size=cfg.mlp_width,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_width,
            hidden_act="silu",
            max_position_embeddings=cfg.seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
            attention_dropout=cfg.dropout,
        )
        if cfg.family == "llama":
            config = tf.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
        elif cfg.family == "qwen3":
            config = tf.Qwen3Config(attention_bias=False, use_sliding_window=False, **common)
        elif cfg.family == "qwen3_moe":
            config = tf.Qwen3MoeConfig(
                attention_bias=False,
                use_sliding_window=False,
                num_experts=cfg.n_experts,
                num_experts_per_tok=cfg.top_k,
                moe_intermediate_size=cfg.mlp_width,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                norm_topk_prob=cfg.norm_topk_prob,
                router_aux_loss_coef=cfg.router_aux_loss_coef,
                **common,
            )
        else:
            config = tf.MixtralConfig(
                num_local_experts=cfg.n_experts,
                num_experts_per_tok=cfg.top_k,
                router_aux_loss_coef=cfg.router_aux_loss_coef,
                router_jitter_noise=0.0,
                sliding_window=None,
                **common,
            )
    config.architectures = [ARCHITECTURES[cfg.family]]
    config.dtype = torch.float32
    return config


def hf_config(cfg: ModelConfig, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """The config.json content: what save_pretrained writes, plus the keys transformers 4.x reads
    (``torch_dtype``; Llama's and Mixtral's top-level ``rope_theta``), which transformers 5 accepts
    and ignores."""
    config = hf_config_object(cfg, bos_token_id, eos_token_id)
    legacy = {"torch_dtype": "float32"}
    if cfg.family in ROPE:
        legacy["rope_theta"] = float(cfg.rope_theta)
    return config.to_diff_dict() | legacy


# -- import --------------------------------------------------------------------------------------
def _mlp_fields(hidden: int, dim: int) -> dict:
    """An MLP width as mlp_ratio when it is a multiple of dim, else as mlp_hidden (mlp_ratio then
    stays at its default: ModelConfig refuses both)."""
    if hidden % dim == 0:
        return {"mlp_ratio": hidden // dim, "mlp_hidden": None}
    return {"mlp_ratio": defaults(ModelConfig)["mlp_ratio"], "mlp_hidden": hidden}


def _gpt2_fields(c) -> dict:
    refuse_if(
        c.activation_function != "gelu_new",
        f"activation_function={c.activation_function!r} (only 'gelu_new' is implemented)",
    )
    refuse_if(not c.scale_attn_weights, "scale_attn_weights=false (our scores are scaled by head_dim**-0.5)")
    refuse_if(c.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=true is not implemented")
    refuse_if(c.reorder_and_upcast_attn, "reorder_and_upcast_attn=true is not implemented")
    refuse_if(c.add_cross_attention, "add_cross_attention=true (our decoder has no cross-attention)")
    refuse_if(c.n_embd % c.n_head != 0, f"n_embd={c.n_embd} is not a multiple of n_head={c.n_head}")
    drops = {"resid_pdrop": c.resid_pdrop, "embd_pdrop": c.embd_pdrop, "attn_pdrop": c.attn_pdrop}
    refuse_if(len(set(drops.values())) > 1, f"dropouts differ {drops} (model.dropout is one probability)")
    hidden = c.n_inner if c.n_inner is not None else 4 * c.n_embd
    return dict(
        family="gpt2",
        vocab_size=c.vocab_size,
        seq_len=c.n_positions,
        dim=c.n_embd,
        n_heads=c.n_head,
        n_layers=c.n_layer,
        **_mlp_fields(hidden, c.n_embd),
        tie_embeddings=bool(c.tie_word_embeddings),
        norm_eps=float(c.layer_norm_epsilon),
        dropout=float(c.resid_pdrop),
    )


def _mixtral_fields(c) -> dict:
    refuse_if(
        c.sliding_window is not None, f"sliding_window={c.sliding_window} (our attention sees every token)"
    )
    refuse_if(bool(c.router_jitter_noise), f"router_jitter_noise={c.router_jitter_noise} is not implemented")
    return dict(
        n_experts=c.num_local_experts,
        top_k=c.num_experts_per_tok,
        router_aux_loss_coef=float(c.router_aux_loss_coef),
    )


def _qwen3_fields(c) -> dict:
    refuse_if(bool(c.use_sliding_window), "use_sliding_window=true (our attention sees every token)")
    if c.model_type != "qwen3_moe":
        return {}
    refuse_if(
        c.decoder_sparse_step != 1, f"decoder_sparse_step={c.decoder_sparse_step} (every block sparse here)"
    )
    refuse_if(bool(c.mlp_only_layers), f"mlp_only_layers={c.mlp_only_layers} (every block sparse here)")
    return dict(
        n_experts=c.num_experts,
        top_k=c.num_experts_per_tok,
        router_aux_loss_coef=float(c.router_aux_loss_coef),
        norm_topk_prob=bool(c.norm_topk_prob),
    )


def _llama_fields(c, raw: dict) -> dict:
    """Llama's fields, Qwen3's (Llama with per-head q/k norms) and Mixtral's (Llama's attention,
    experts for the MLP)."""
    refuse_if(
        c.hidden_act not in ("silu", "swish"), f"hidden_act={c.hidden_act!r} (only 'silu' is implemented)"
    )
    # (MixtralConfig has neither bias key: its projections never have one)
    refuse_if(bool(getattr(c, "attention_bias", False)), "attention_bias=true (our projections have no bias)")
    refuse_if(bool(getattr(c, "mlp_bias", False)), "mlp_bias=true (our MLP has no bias)")
    heads, dim, kv = c.num_attention_heads, c.hidden_size, c.num_key_value_heads
    head_dim = c.head_dim or dim // heads  # MixtralConfig leaves it null for hidden_size // heads
    natural = dim % heads == 0 and head_dim == dim // heads  # model.head_dim null then
    refuse_if(
        not natural and c.model_type == "mixtral",
        f"head_dim={c.head_dim} with hidden_size={dim} and num_attention_heads={heads} (mixtral's heads are "
        f"hidden_size // num_attention_heads wide here)",
    )
    refuse_if(heads % kv != 0, f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    return dict(
        family=c.model_type,
        vocab_size=c.vocab_size,
        seq_len=c.max_position_embeddings,
        dim=dim,
        n_heads=heads,
        n_layers=c.num_hidden_layers,
        # each expert's width, for Qwen3-MoE (every block sparse: intermediate_size is unused)
        **_mlp_fields(c.moe_intermediate_size if c.model_type == "qwen3_moe" else c.intermediate_size, dim),
        n_kv_heads=None if kv == heads else kv,
        head_dim=None if natural else head_dim,
        tie_embeddings=bool(c.tie_word_embeddings),
        norm_eps=float(c.rms_norm_eps),
        rope_theta=rope_theta(c, raw),
        dropout=float(c.attention_dropout or 0.0),
        **(_mixtral_fields(c) if c.model_type == "mixtral" else {}),
        **(_qwen3_fields(c) if c.model_type in HEAD_NORMS else {}),
    )


def config_fields(config_dict: dict) -> dict:
    """ModelConfig fields for a Hugging Face config.json (HFError for anything not exact)."""
    model_type = config_dict.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HFError(
            f"model_type {model_type!r} is not supported (only 'gpt2', 'llama', 'qwen3', 'mixtral', "
            f"'qwen3_moe' and 'deepseek_v3' convert exactly)"
        )
    cls = getattr(transformers_module(), CONFIG_CLASSES[model_type])
    try:
        config = cls.from_dict(dict(config_dict))
    except (TypeError, ValueError, KeyError) as exc:
        raise HFError(f"config.json is not a valid {model_type} config: {str(exc).splitlines()[0]}") from exc
    if model_type == "deepseek_v3":
        return hf_deepseek.fields(config, config_dict)
    return _gpt2_fields(config) if model_type == "gpt2" else _llama_fields(config, config_dict)


def _head_dim_set(m: ModelConfig) -> int | None:
    """The head width where it is not dim / n_heads (a head_dim equal to it is no head_dim)."""
    natural = m.dim % m.n_heads == 0 and m.head_width == m.dim // m.n_heads
    return None if natural else m.head_width


# What must agree between a run's model config and a directory it starts from (model.init_from):
# everything that fixes the shapes or the arithmetic. dropout and activation checkpointing are the
# run's own choice. The MLP width and the key/value heads are compared as what they give. The
# context is the run's too, up to what learned position embeddings hold (``differences``).
_MATCHED = {
    "model.family": lambda m: m.family,
    "model.vocab_size": lambda m: m.vocab_size,
    "model.dim": lambda m: m.dim,
    "model.n_heads": lambda m: m.n_heads,
    "model.n_layers": lambda m: m.n_layers,
    "the MLP width (model.mlp_hidden, or model.mlp_ratio x model.dim)": lambda m: m.mlp_width,
    "model.n_kv_heads": lambda m: m.kv_heads,
    "model.head_dim": _head_dim_set,
    "model.tie_embeddings": lambda m: m.tie_embeddings,
    "model.norm_eps": lambda m: m.norm_eps,
    "model.rope_theta": lambda m: m.rope_theta if m.family in ROPE else None,
    "model.n_experts": lambda m: m.n_experts,
    "model.top_k": lambda m: m.top_k,
    "model.norm_topk_prob": lambda m: m.norm_topk_prob,
    "the dense blocks' MLP width (model.dense_mlp_hidden, or model.mlp_ratio x model.dim)": lambda m: (
        m.dense_width if m.family == "deepseek_v3" else None
    ),
} | {f"model.{k}": lambda m, k=k: getattr(m, k) for k in DEEPSEEK_KEYS if k != "dense_mlp_hidden"}


def differences(run: ModelConfig, theirs: ModelConfig) -> list[str]:
    """Where ``run`` and an imported config differ, each as '<key>=ours (the directory's: theirs)'.
    A shorter context is no difference (a learned position table is cut to it: ``positions_for``),
    nor a longer one with rotary positions, which any position has."""
    found = [
        f"{name}={value(run)} (the directory's: {value(theirs)})"
        for name, value in _MATCHED.items()
        if value(run) != value(theirs)
    ]
    if run.family not in ROPE and run.seq_len > theirs.seq_len:
        found.append(f"model.seq_len={run.seq_len} (the directory's learned positions: {theirs.seq_len})")
    return found


def positions_for(run: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with its learned position table cut to ``run.seq_len`` rows: the first positions
    are what the directory's model computes for a sequence that short."""
    table = state.get("pos_emb.weight")
    if table is None or table.shape[0] == run.seq_len:
        return state
    return {**state, "pos_emb.weight": table[: run.seq_len]}
