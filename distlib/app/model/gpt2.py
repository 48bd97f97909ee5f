"""GPT-2, computing what transformers' ``GPT2LMHeadModel`` (eager attention) computes.

Learned token + position embeddings (dropout on their sum), pre-LayerNorm blocks: fused q|k|v
projection with bias, scores scaled by head_dim**-0.5, softmax in the activations' dtype, dropout
on the attention weights and on both residual branches, MLP fc -> GELU (tanh approximation,
transformers' "gelu_new" formula term by term) -> proj; final LayerNorm; LM head without bias, tied
to the token embedding when ``model.tie_embeddings``. Linear layers are ``nn.Linear``
(transformers' Conv1D holds the transposed weight; ``hf_weights`` transposes). MiniGPT is this
class with its own arithmetic in four class attributes (``minigpt.py``).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import attention
from distlib.app.model.attention import causal_mask, split_heads
from distlib.app.model.layers import CausalLM, PreNormBlock, in_documents
from distlib.app.model.strategies import LOCAL, Strategies
from distlib.parallel.documents import Documents
from distlib.parallel.dropout import Draws, dropout
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


def layer_norm(cfg: ModelConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)


class CausalSelfAttention(nn.Module):
    """Fused q|k|v (with bias) -> causal attention -> proj; dropout on the attention weights (the
    block drops the output, the residual branch). ``divide``: MiniGPT's scores / sqrt(head_dim)
    instead of transformers' * head_dim**-0.5."""

    def __init__(
        self, cfg: ModelConfig, divide: bool = False, *, context: attention.Context = attention.WHOLE
    ):
        super().__init__()
        self.head_dim = cfg.head_width
        self.divide = divide
        self.scale = math.sqrt(self.head_dim) if divide else self.head_dim**-0.5
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout
        self.register_buffer("causal_mask", causal_mask(cfg.seq_len), persistent=False)
        self.context = context  # dist.cp > 1: attention.ContextSplit (strategies.py)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        draws: Draws | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        # Learned positions entered with the embedding and the mask is relative: ``positions`` unused.
        # q|k|v of this rank's heads (all of them, or H/T with a column-parallel qkv): transformers' split.
        q, k, v = (split_heads(t, self.head_dim) for t in self.qkv(x).chunk(3, dim=2))
        out = attention.causal_attention(
            q,
            k,
            v,
            self.causal_mask,
            scale=self.scale,
            divide=self.divide,
            dropout=self.dropout,
            training=self.training,
            context=self.context,
            draws=draws,
            documents=documents,
        )
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, activation=gelu_new):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_width)
        self.proj = nn.Linear(cfg.mlp_width, cfg.dim)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.activation(self.fc(x)))  # the block drops the output


class GPT2(CausalLM):
    """The GPT skeleton; the class attributes are where MiniGPT's arithmetic departs from it."""

    EMBEDDINGS = ("tok_emb", "pos_emb")
    ACTIVATION = staticmethod(gelu_new)
    DIVIDE_SCORES = False
    HEAD_BIAS = False
    EMBEDDING_DROPOUT = True

    def __init__(self, cfg: ModelConfig, strategies: Strategies = LOCAL):
        super().__init__(cfg, strategies)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        attention = partial(CausalSelfAttention, divide=self.DIVIDE_SCORES)
        mlp = partial(MLP, activation=self.ACTIVATION)
        self.blocks = nn.ModuleList(
            PreNormBlock(
                cfg, layer_norm, attention, mlp, index=i, residual_dropout=True, strategies=strategies
            )
            for i in range(cfg.n_layers)
        )
        self.ln_f = layer_norm(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=self.HEAD_BIAS)
        self._init_and_tie()

    def _embed(
        self, tokens: torch.Tensor, positions: torch.Tensor, draws: Draws | None, documents
    ) -> torch.Tensor:
        # positions within documents embedded; the dropout masks stay keyed by the sequence's
        x = self.tok_emb(tokens) + self.pos_emb(in_documents(positions, documents))
        if not self.EMBEDDING_DROPOUT:
            return x
        full = (self.cfg.seq_len, self.cfg.dim)  # the sequence's mask, kept at these positions
        return dropout(x, self.cfg.dropout, self.training, draws, "embed", full, (positions, None))


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
