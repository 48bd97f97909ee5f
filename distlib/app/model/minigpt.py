"""MiniGPT: a GPT-style decoder small enough to train on 4 CPU ranks in seconds.

nanoGPT's shape: token + learned position embeddings, pre-LayerNorm blocks of
causal multi-head self-attention and a GELU MLP, a final LayerNorm, and an LM
head that is a separate Linear (not tied to the embedding). Attention uses the
explicit masked path (scores, -inf above the diagonal, softmax) so every rank
and every parallel layout runs the same arithmetic.

Tensor parallelism (``shard_model_``) swaps the attention and MLP Linear layers for this rank's
column/row-parallel shards (``TENSOR_PARALLEL_PLAN``); the forward below is the same code at every
tensor-parallel degree: attention derives its local head count from the width of the qkv output.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from distlib.app.config.groups import ModelConfig
from distlib.app.observe import activations
from distlib.comm.group import Comm
from distlib.parallel.tensor_parallel import Column, Row, Split, parallelize_linears_


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


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)
        self.checkpointing = cfg.activation_checkpointing == "blocks"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled() and x.requires_grad:
            # Keep only the input; backward reruns _forward (torch restores the RNG state first, so
            # dropout draws the same masks). _forward is called directly, not through the module:
            # the recomputation must not fire this block's hooks again (ZeRO-3's forward hook frees
            # the parameters; its hook on the block's output has gathered them before this runs).
            activations.keep(x)
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MiniGPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size)  # untied from tok_emb on purpose
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for ``tokens`` (batch, seq); with ``targets``, the mean cross-entropy loss."""
        seq = tokens.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.seq_len={self.cfg.seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def param_count(cfg: ModelConfig) -> int:
    """P of the whole (unsplit) MiniGPT, from its shape alone: the same sum as its parameters' numel,
    without building one (even on the meta device, nn.init imports torch._dynamo: +1.3 s a process)."""
    d, hidden, v = cfg.dim, cfg.mlp_ratio * cfg.dim, cfg.vocab_size
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * hidden + hidden) + (hidden * d + d)
    return v * d + cfg.seq_len * d + cfg.n_layers * block + 2 * d + (d * v + v)


def build_model(cfg: ModelConfig, seed: int) -> MiniGPT:
    """A MiniGPT whose initial weights depend only on ``seed`` (not on global RNG state), drawn on
    the CPU whatever the default device: every device then starts from the same bytes."""
    fork = torch.random.fork_rng(devices=[])
    with fork, torch.device("cpu"):
        torch.manual_seed(seed)
        return MiniGPT(cfg)


# Megatron's split of a block: attention by heads (the fused q|k|v rows of a head stay on one
# rank), the MLP by hidden units; each half column-parallel, then row-parallel.
TENSOR_PARALLEL_PLAN = {
    "blocks.*.attn.qkv": Column(groups=3),
    "blocks.*.attn.proj": Row(),
    "blocks.*.mlp.fc": Column(),
    "blocks.*.mlp.proj": Row(),
}


def shard_model_(model: MiniGPT, tp: Comm) -> dict[str, Split]:
    """Replace every block's attention and MLP Linear layers with this rank's tensor-parallel
    shard of them (in place, keeping parameter names and order); returns each split parameter's
    Split (none with a tensor-parallel group of one)."""
    if model.cfg.n_heads % tp.size:
        raise ValueError(
            f"dist.tp={tp.size} must divide model.n_heads={model.cfg.n_heads} (heads are split across "
            f"tensor-parallel ranks)"
        )
    return parallelize_linears_(model, tp, TENSOR_PARALLEL_PLAN)
