"""Qwen3-MoE, computing what transformers' ``Qwen3MoeForCausalLM`` computes (eager attention, no
sliding window, every block sparse).

Qwen3's attention (``qwen3.Attention``: an RMSNorm on every query and key head, heads of
``model.head_dim``) in Mixtral's model (``mixtral.Mixtral``: each block's MLP a sparse mixture of
SwiGLU experts, the load-balancing loss added in training, every layout Mixtral runs in). What
differs from Mixtral's routing is one switch, ``model.norm_topk_prob``: transformers' Qwen3-MoE
renormalises a token's top_k probabilities only when it is set (Mixtral always does). Its files
name the router ``mlp.gate`` and the experts ``mlp.experts.<e>.gate_proj / up_proj / down_proj``
(ours: ``w1 / w3 / w2``; ``hf_weights``). Blocks with a dense MLP (transformers'
``decoder_sparse_step`` > 1, ``mlp_only_layers``) are not implemented: an import with them is
refused.
"""

from __future__ import annotations

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import mixtral, qwen3

TENSOR_PARALLEL_PLAN = mixtral.TENSOR_PARALLEL_PLAN


class Qwen3Moe(mixtral.Mixtral):
    ATTENTION = qwen3.Attention


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Mixtral's, with each block's two head norms."""
    return qwen3.with_head_norms(mixtral.param_shapes(cfg), cfg)
