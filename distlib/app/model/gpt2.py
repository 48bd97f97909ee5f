"""GPT-2, computing what transformers' ``GPT2LMHeadModel`` (eager attention) computes.

Learned token + position embeddings (dropout on their sum), pre-LayerNorm blocks: fused q|k|v
projection with bias, scores scaled by head_dim**-0.5, softmax in the activations' dtype, dropout
on the attention weights and on both residual branches, MLP fc -> GELU (tanh approximation,
transformers' "gelu_new" formula term by term) -> proj; final LayerNorm; LM head without bias, tied
to the token embedding when ``model.tie_embeddings``. Linear layers are ``nn.Linear``
(transformers' Conv1D holds the transposed weight; ``hf_weights`` transposes).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlib.app.config.groups import ModelConfig
from distlib.app.model.layers import (
    CausalLM,
    CheckpointedBlock,
    attention_scores,
    causal_mask,
    merge_heads,
    split_heads,
)
from distlib.parallel.tensor_parallel import Column, Row

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
    """transformers' NewGELUActivation, operation for operation: F.gelu(approximate="tanh") differs by
    ~4e-7 on fp32 logits and ~8e-3 on bf16 logits (measured)."""
    return 0.5 * x * (1.0 + torch.tanh(_GELU_C * (x + 0.044715 * torch.pow(x, 3.0))))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5  # transformers: scaling = head_dim**-0.5, multiplied
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout
        self.register_buffer("causal_mask", causal_mask(cfg.seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # q|k|v of this rank's heads (all of them, or H/T with a column-parallel qkv): transformers' split.
        q, k, v = (split_heads(t, self.head_dim) for t in self.qkv(x).chunk(3, dim=2))
        scores = attention_scores(q, k, self.scale, self.causal_mask)
        weights = F.softmax(scores, dim=-1).type(v.dtype)
        weights = F.dropout(weights, self.dropout, self.training)
        return F.dropout(self.proj(merge_heads(weights @ v)), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_width)
        self.proj = nn.Linear(cfg.mlp_width, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(gelu_new(self.fc(x))), self.dropout, self.training)


class Block(CheckpointedBlock):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.activation_checkpointing)
        self.ln1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers adds the branch to the residual as attn_output + residual: the same sum.
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(CausalLM):
    EMBEDDINGS = ("tok_emb", "pos_emb")

    def __init__(self, cfg: ModelConfig):
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


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state_dict entry's shape (a tied lm_head.weight included), without building a model."""
    d, h = cfg.dim, cfg.mlp_width
    shapes = {"tok_emb.weight": (cfg.vocab_size, d), "pos_emb.weight": (cfg.seq_len, d)}
    block = {
        "ln1.weight": (d,),
        "ln1.bias": (d,),
        "attn.qkv.weight": (3 * d, d),
        "attn.qkv.bias": (3 * d,),
        "attn.proj.weight": (d, d),
        "attn.proj.bias": (d,),
        "ln2.weight": (d,),
        "ln2.bias": (d,),
        "mlp.fc.weight": (h, d),
        "mlp.fc.bias": (h,),
        "mlp.proj.weight": (d, h),
        "mlp.proj.bias": (d,),
    }
    for i in range(cfg.n_layers):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,), "lm_head.weight": (cfg.vocab_size, d)})
    return shapes
