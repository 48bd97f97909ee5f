"""MiniGPT: a GPT-style decoder small enough to train on 4 CPU ranks in seconds.

nanoGPT's shape: token + learned position embeddings, pre-LayerNorm blocks of
causal multi-head self-attention and a GELU MLP, a final LayerNorm, and an LM
head that is a separate Linear (not tied to the embedding). Attention uses the
explicit masked path (scores, -inf above the diagonal, softmax) so every rank
and every parallel layout runs the same arithmetic.

Tensor parallelism (``families.shard_model_``) swaps the attention and MLP Linear layers for this rank's
column/row-parallel shards (``TENSOR_PARALLEL_PLAN``); the forward below is the same code at every
tensor-parallel degree: attention derives its local head count from the width of the qkv output.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlib.app.config.groups import ModelConfig
from distlib.app.model.layers import CausalLM, CheckpointedBlock, init_weights, seeded
from distlib.parallel.tensor_parallel import Column, Row


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout
        mask = torch.ones(
            cfg.seq_len, cfg.seq_len, dtype=torch.bool, device="cpu"
        ).tril()  # moved with the model
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # q|k|v of the heads this rank computes: all n_heads, or H/T of them when qkv is
        # column-parallel (then proj is row-parallel and sums the heads' contributions over ranks).
        q, k, v = self.qkv(x).chunk(3, dim=2)
        # (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.causal_mask[:seq, :seq], float("-inf"))
        weights = F.dropout(F.softmax(scores, dim=-1), self.dropout, self.training)
        out = (weights @ v).transpose(1, 2).reshape(batch, seq, -1)
        return F.dropout(self.proj(out), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(CheckpointedBlock):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.activation_checkpointing)
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MiniGPT(CausalLM):
    EMBEDDINGS = ("tok_emb", "pos_emb")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size)  # untied from tok_emb on purpose
        self.apply(init_weights)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok_emb(tokens) + self.pos_emb(positions)


def param_count(cfg: ModelConfig) -> int:
    """P of the whole (unsplit) MiniGPT, from its shape alone: the same sum as its parameters' numel,
    without building one (even on the meta device, nn.init imports torch._dynamo: +1.3 s a process)."""
    d, hidden, v = cfg.dim, cfg.mlp_ratio * cfg.dim, cfg.vocab_size
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * hidden + hidden) + (hidden * d + d)
    return v * d + cfg.seq_len * d + cfg.n_layers * block + 2 * d + (d * v + v)


def build_model(cfg: ModelConfig, seed: int) -> MiniGPT:
    """A MiniGPT whose initial weights depend only on ``seed`` (not on global RNG state), drawn on
    the CPU whatever the default device: every device then starts from the same bytes."""
    return seeded(MiniGPT, cfg, seed)


# Megatron's split of a block: attention by heads (the fused q|k|v rows of a head stay on one
# rank), the MLP by hidden units; each half column-parallel, then row-parallel.
TENSOR_PARALLEL_PLAN = {
    "blocks.*.attn.qkv": Column(groups=3),
    "blocks.*.attn.proj": Row(),
    "blocks.*.mlp.fc": Column(),
    "blocks.*.mlp.proj": Row(),
}
