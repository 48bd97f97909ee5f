"""DeepSeek-V3 <-> transformers' DeepseekV3Config and DeepseekV3ForCausalLM's tensor names.

Export: ``config(cfg, common)`` is the config object of ``hf_config.hf_config_object``; import:
``fields(c, raw)`` our ModelConfig fields from transformers' config object, refusing what our model
would not compute as transformers does (``HFError``, one line): key/value heads other than the
query heads (transformers' eager attention repeats kv_b_proj's heads to n_heads / n_kv_heads),
attention biases, a non-SiLU activation, RoPE scaling or rope_interleave=false.

Names (``block_names``): the latent attention's projections and norms keep transformers' names
under ``attn.``; the dense blocks' MLP and the shared experts are named alike; the routed experts
are ``mlp.experts.<e>.gate_proj / up_proj / down_proj`` in the files (ours: ``w1 / w3 / w2``). Each
router's ``e_score_correction_bias`` is our selection bias (``model.balance=bias``:
``blocks.<b>.mlp.score_bias``), zeros without one.
"""

from __future__ import annotations

from distlib.app.config.model_group import ModelConfig
from distlib.app.model.bias_balance import STATE
from distlib.app.model.hf_common import refuse_if, rope_theta

EXPERT_FILES = ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})
CORRECTION = "e_score_correction_bias"


def config(tf, cfg: ModelConfig, common: dict):
    """transformers' DeepseekV3Config of ``cfg``; ``common``: the keys every family's config takes."""
    return tf.DeepseekV3Config(
        hidden_size=cfg.dim,
        intermediate_size=cfg.dense_width,
        moe_intermediate_size=cfg.mlp_width,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        n_shared_experts=cfg.n_shared_experts,
        n_routed_experts=cfg.n_experts,
        routed_scaling_factor=cfg.routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        v_head_dim=cfg.v_head_dim,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        num_experts_per_tok=cfg.top_k,
        first_k_dense_replace=cfg.first_k_dense_replace,
        norm_topk_prob=cfg.norm_topk_prob,
        hidden_act="silu",
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        rope_interleave=True,
        attention_bias=False,
        attention_dropout=cfg.dropout,
        num_nextn_predict_layers=0,
        **common,
    )


def fields(c, raw: dict) -> dict:
    """Our ModelConfig fields of transformers' DeepseekV3Config ``c`` (config.json ``raw``)."""
    refuse_if(
        c.hidden_act not in ("silu", "swish"), f"hidden_act={c.hidden_act!r} (only 'silu' is implemented)"
    )
    refuse_if(bool(c.attention_bias), "attention_bias=true (our projections have no bias)")
    refuse_if(not c.rope_interleave, "rope_interleave=false (the rotary pairs are interleaved here)")
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    refuse_if(
        kv != heads,
        f"num_key_value_heads={kv} with num_attention_heads={heads} (latent attention has a key and "
        f"value per query head; transformers' eager attention would repeat them)",
    )
    dim = c.hidden_size
    return dict(
        family="deepseek_v3",
        vocab_size=c.vocab_size,
        seq_len=c.max_position_embeddings,
        dim=dim,
        n_heads=heads,
        n_layers=c.num_hidden_layers,
        **_widths(c.moe_intermediate_size, c.intermediate_size, dim),
        tie_embeddings=bool(c.tie_word_embeddings),
        norm_eps=float(c.rms_norm_eps),
        rope_theta=rope_theta(c, raw),
        dropout=float(c.attention_dropout or 0.0),
        n_experts=c.n_routed_experts,
        top_k=c.num_experts_per_tok,
        norm_topk_prob=bool(c.norm_topk_prob),
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        first_k_dense_replace=c.first_k_dense_replace,
        n_shared_experts=c.n_shared_experts,
        n_group=c.n_group,
        topk_group=c.topk_group,
        routed_scaling_factor=float(c.routed_scaling_factor),
    )


def _widths(experts: int, dense: int, dim: int) -> dict:
    """The experts' width as mlp_ratio when a multiple of dim (else mlp_hidden); the dense blocks'
    as dense_mlp_hidden unless it is what that mlp_ratio gives."""
    if experts % dim == 0:
        out = {"mlp_ratio": experts // dim, "mlp_hidden": None}
    else:
        out = {"mlp_ratio": 4, "mlp_hidden": experts}
    return out | {"dense_mlp_hidden": None if dense == out["mlp_ratio"] * dim else dense}


def block_names(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    """(ours, transformers') of block ``i``'s weights, after the block prefixes, without the
    '.weight' suffix; the router's correction bias is listed by ``bias_names``."""
    if cfg.q_lora_rank is None:
        query = ["q_proj"]
    else:
        query = ["q_a_proj", "q_a_layernorm", "q_b_proj"]
    attn = [*query, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    pairs = [("ln1", "input_layernorm")]
    pairs += [(f"attn.{n}", f"self_attn.{n}") for n in attn]
    pairs.append(("ln2", "post_attention_layernorm"))
    mlp = ["gate_proj", "up_proj", "down_proj"]
    if i < cfg.first_k_dense_replace:
        return pairs + [(f"mlp.{n}", f"mlp.{n}") for n in mlp]
    called = EXPERT_FILES[1]
    experts = [
        (f"mlp.experts.{e}.{w}", f"mlp.experts.{e}.{called[w]}")
        for e in range(cfg.n_experts)
        for w in ("w1", "w2", "w3")
    ]
    shared = [(f"mlp.shared_experts.{n}", f"mlp.shared_experts.{n}") for n in mlp]
    return pairs + [("mlp.gate", "mlp.gate"), *experts, *shared]


def bias_names(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our selection bias's name, transformers' correction bias's) of each MoE block."""
    return [(f"blocks.{i}.mlp.{STATE}", f"model.layers.{i}.mlp.gate.{CORRECTION}") for i in cfg.moe_layers]
