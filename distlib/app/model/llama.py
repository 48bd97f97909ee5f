"""Llama, computing what transformers' ``LlamaForCausalLM`` (eager attention) computes.

Token embedding (no position embedding), pre-RMSNorm blocks: q/k/v/o projections without bias,
rotary position embeddings on q and k in transformers' layout (halves rotated, cos/sin of
cat(freqs, freqs)), grouped-query attention (each key/value head serves n_heads / n_kv_heads
consecutive query heads), softmax in float32, dropout on the attention weights only
(transformers' attention_dropout); SwiGLU MLP down(silu(gate(x)) * up(x)); final RMSNorm; LM head
without bias, tied or not. Default RoPE only (no scaling); head_dim (model.head_dim) may differ from
dim // n_heads.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import attention
from distlib.app.model.attention import causal_mask
from distlib.app.model.layers import CausalLM, PreNormBlock, in_documents, positions_or_default
from distlib.app.model.strategies import LOCAL, Strategies
from distlib.parallel.documents import Documents
from distlib.parallel.dropout import Draws
from distlib.parallel.tensor_parallel import Column, Row

# q, k and v by heads (the key/value heads split over the ranks too, so rank t's query heads find
# their key/value heads locally), o_proj row-parallel; the MLP by hidden units.
TENSOR_PARALLEL_PLAN = {
    "blocks.*.attn.q_proj": Column(),
    "blocks.*.attn.k_proj": Column(),
    "blocks.*.attn.v_proj": Column(),
    "blocks.*.attn.o_proj": Row(),
    "blocks.*.mlp.gate_proj": Column(),
    "blocks.*.mlp.up_proj": Column(),
    "blocks.*.mlp.down_proj": Row(),
}


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalize in float32, cast back to the input dtype, then scale by
    the weight (in the weight's dtype: a bf16 weight times a bf16 activation stays bf16)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The default RoPE inverse frequencies, 1 / theta^(arange(0, d, 2) / d), float32 on the CPU."""
    d = cfg.head_width
    return 1.0 / (float(cfg.rope_theta) ** (torch.arange(0, d, 2, dtype=torch.float, device="cpu") / d))


def rope_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (seq, head_dim), at ``positions`` (seq,), as LlamaRotaryEmbedding.forward computes
    them: in float32 from the inv_freq buffer as it is (a module.to(bf16) rounds transformers' buffer
    too), then cast to ``dtype``. Positions per sequence (batch, seq), as packed documents have:
    (batch, 1, seq, head_dim), broadcast over the heads."""
    freqs = positions.to(inv_freq.device).float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    if positions.dim() == 2:
        emb = emb[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, context: attention.Context = attention.WHOLE):
        super().__init__()
        self.head_dim = cfg.head_width
        self.scale = self.head_dim**-0.5
        q_width, kv_width = cfg.n_heads * self.head_dim, cfg.kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.dim, q_width, bias=False)
        self.k_proj = nn.Linear(cfg.dim, kv_width, bias=False)
        self.v_proj = nn.Linear(cfg.dim, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, cfg.dim, bias=False)
        self.dropout = cfg.dropout
        self.register_buffer("causal_mask", causal_mask(cfg.seq_len), persistent=False)
        self.context = context  # dist.cp > 1: attention.ContextSplit (strategies.py)
        # Not cos/sin tables: transformers recomputes them from inv_freq in every forward, on the
        # model's device (precomputed fp32 tables did not match it after module.to(bf16)).
        self.register_buffer("inv_freq", inv_frequencies(cfg), persistent=False)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of this rank's heads, (batch, seq, heads, head_dim): the head counts come from
        the (possibly column-parallel) widths."""
        shape = (*x.shape[:2], -1, self.head_dim)
        return self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        draws: Draws | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in self.heads(x))  # (batch, heads, seq, head_dim)
        # transformers casts cos/sin to the activations' dtype (bf16 with bf16 parameters) before rotating.
        positions = positions_or_default(positions, x.shape[1], x.device)
        cos, sin = rope_tables(self.inv_freq, in_documents(positions, documents), q.dtype)
        q, k = (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
        # k and v keep their n_kv_heads (per rank: tp divides them): repeated to the query heads only
        # where attention is computed, so context parallelism moves the grouped heads
        out = attention.causal_attention(
            q,
            k,
            v,
            self.causal_mask,
            scale=self.scale,
            softmax_dtype=torch.float32,
            dropout=self.dropout,
            training=self.training,
            context=self.context,
            draws=draws,
            documents=documents,
        )
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int | None = None):
        """``width``: the hidden units (DeepSeek's dense and shared MLPs); None = model.mlp_width."""
        super().__init__()
        width = cfg.mlp_width if width is None else width
        self.gate_proj = nn.Linear(cfg.dim, width, bias=False)
        self.up_proj = nn.Linear(cfg.dim, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rms_norm(cfg: ModelConfig) -> RMSNorm:
    return RMSNorm(cfg.dim, cfg.norm_eps)  # ln1/ln2: transformers' input_/post_attention_layernorm


class Llama(CausalLM):
    ATTENTION = Attention  # Qwen3: its own, with the head norms (qwen3.py)

    def __init__(self, cfg: ModelConfig, strategies: Strategies = LOCAL):
        super().__init__(cfg, strategies)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(
            PreNormBlock(cfg, rms_norm, self.ATTENTION, MLP, index=i, strategies=strategies)
            for i in range(cfg.n_layers)
        )
        self.ln_f = rms_norm(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._init_and_tie()

    def _embed(
        self, tokens: torch.Tensor, positions: torch.Tensor, draws: Draws | None, documents
    ) -> torch.Tensor:
        return self.tok_emb(tokens)  # positions enter as rotary angles, in each attention


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state_dict entry's shape (a tied lm_head.weight included), without building a model."""
    d, h = cfg.dim, cfg.mlp_width
    q, kv = cfg.n_heads * cfg.head_width, cfg.kv_heads * cfg.head_width
    block = {
        "ln1.weight": (d,),
        "attn.q_proj.weight": (q, d),
        "attn.k_proj.weight": (kv, d),
        "attn.v_proj.weight": (kv, d),
        "attn.o_proj.weight": (d, q),
        "ln2.weight": (d,),
        "mlp.gate_proj.weight": (h, d),
        "mlp.up_proj.weight": (h, d),
        "mlp.down_proj.weight": (d, h),
    }
    shapes = {"tok_emb.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    shapes.update({"ln_f.weight": (d,), "lm_head.weight": (cfg.vocab_size, d)})
    return shapes
