"""Qwen3, computing what transformers' ``Qwen3ForCausalLM`` (eager attention) computes.

Llama's arithmetic (``llama.py``) with one addition in the attention: an RMSNorm over the head
dimension of every query head and every key head (``q_norm``, ``k_norm``: one weight of head_dim
each, shared by the heads), applied to the projections before the rotary embedding, as
transformers does on its (batch, seq, heads, head_dim) view. Qwen3's head_dim is usually not
dim / n_heads (``model.head_dim``). No sliding window (transformers' default,
``use_sliding_window=false``; an import with it is refused), no projection biases.

Tensor parallelism splits the heads; the two norms' weights stay whole on every rank but each
rank applies them to its own heads only, so their gradients are summed over the tensor-parallel
group (``head_shared_parameters``, ``families.partial_over_tp``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import attention, llama

TENSOR_PARALLEL_PLAN = llama.TENSOR_PARALLEL_PLAN


class Attention(llama.Attention):
    # the forward's order (ZeRO's memory prediction reads it): the norms act on q and k before o_proj
    PARAMETER_USE = ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj")

    def __init__(self, cfg: ModelConfig, *, context: attention.Context = attention.WHOLE):
        super().__init__(cfg, context=context)
        self.q_norm = llama.RMSNorm(self.head_dim, cfg.norm_eps)
        self.k_norm = llama.RMSNorm(self.head_dim, cfg.norm_eps)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().heads(x)
        return self.q_norm(q), self.k_norm(k), v

    def head_shared_parameters(self) -> list[nn.Parameter]:
        """The norms' weights: every head uses them, each tensor-parallel rank on its heads only."""
        return [self.q_norm.weight, self.k_norm.weight]


class Qwen3(llama.Llama):
    ATTENTION = Attention


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Llama's, with each block's two head norms (``with_head_norms``)."""
    return with_head_norms(llama.param_shapes(cfg), cfg)


def with_head_norms(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``shapes`` with each block's q_norm and k_norm after its attention's projections (the order
    the attention registers them in)."""
    out = {}
    for name, shape in shapes.items():
        out[name] = shape
        if name.endswith(".attn.o_proj.weight"):
            block = name.removesuffix(".o_proj.weight")
            out[f"{block}.q_norm.weight"] = (cfg.head_width,)
            out[f"{block}.k_norm.weight"] = (cfg.head_width,)
    return out
