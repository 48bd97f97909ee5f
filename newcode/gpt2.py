"""GPT-2 computing what transformers' ``GPT2LMHeadModel`` (eager attention) computes.

Learned token + position embeddings (dropout on their sum), pre-LayerNorm blocks: fused q|k|v
projection with bias, scores scaled by head_dim**-0.5, softmax in the activations' dtype, dropout
on the attention weights and on both residual branches, MLP fc -> GELU (tanh approximation, HF's
"gelu_new" formula term by term) -> proj; final LayerNorm; LM head without bias, tied to the token
embedding when ``cfg.tie_embeddings``. Linear layers are ``nn.Linear`` (HF's Conv1D holds the
transposed weight; ``hf.py`` transposes).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlib.parallel.tensor_parallel import Column, Row
from layers import (CausalLM, CheckpointedBlock, attention_scores, causal_mask, head_dim, merge_heads,
                    mlp_width, seeded, split_heads)

# Megatron's split: attention by heads (a head's q, k and v rows stay on one rank), the MLP by
# hidden units; column-parallel in, row-parallel out.
TENSOR_PARALLEL_PLAN = {
    "blocks.*.attn.qkv": Column(groups=3),
    "blocks.*.attn.proj": Row(),
    "blocks.*.mlp.fc": Column(),
    "blocks.*.mlp.proj": Row(),
}

_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """HF's NewGELUActivation, operation for operation (F.gelu(approximate="tanh") rounds differently)."""
    return 0.5 * x * (1.0 + torch.tanh(_GELU_C * (x + 0.044715 * torch.pow(x, 3.0))))


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_dim = head_dim(cfg)
        self.scale = self.head_dim ** -0.5          # HF: scaling = head_dim**-0.5, multiplied
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout
        self.register_buffer("causal_mask", causal_mask(cfg.seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # q|k|v of this rank's heads (all of them, or H/T with a column-parallel qkv): HF's split.
        q, k, v = (split_heads(t, self.head_dim) for t in self.qkv(x).chunk(3, dim=2))
        scores = attention_scores(q, k, self.scale, self.causal_mask)
        weights = F.softmax(scores, dim=-1).type(v.dtype)
        weights = F.dropout(weights, self.dropout, self.training)
        return F.dropout(self.proj(merge_heads(weights @ v)), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, mlp_width(cfg))
        self.proj = nn.Linear(mlp_width(cfg), cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(gelu_new(self.fc(x))), self.dropout, self.training)


class Block(CheckpointedBlock):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.ln1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF adds the branch to the residual as attn_output + residual: same sum, same rounding.
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(CausalLM):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._init_and_tie()

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        return F.dropout(x, self.cfg.dropout, self.training)


def build(cfg, seed: int) -> GPT2:
    return seeded(GPT2, cfg, seed)


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every state_dict entry's shape (the tied lm_head.weight included), without building a model."""
    d, h = cfg.dim, mlp_width(cfg)
    shapes = {"tok_emb.weight": (cfg.vocab_size, d), "pos_emb.weight": (cfg.seq_len, d)}
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        shapes.update({p + "ln1.weight": (d,), p + "ln1.bias": (d,),
                       p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
                       p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,),
                       p + "ln2.weight": (d,), p + "ln2.bias": (d,),
                       p + "mlp.fc.weight": (h, d), p + "mlp.fc.bias": (h,),
                       p + "mlp.proj.weight": (d, h), p + "mlp.proj.bias": (d,)})
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,), "lm_head.weight": (cfg.vocab_size, d)})
    return shapes
