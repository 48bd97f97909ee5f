"""What the model families share: causal attention arithmetic, the checkpointed block, the
embed -> blocks -> head contract and seeded construction.

Every attention here is the explicit path (scores, masked_fill, softmax, weights @ v), never
``scaled_dot_product_attention``: each tensor-parallel layout and each device then runs the same
arithmetic, and for GPT-2 and Llama it is the arithmetic of transformers' "eager" attention.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from distlib.app.observe import activations


def causal_mask(seq_len: int) -> torch.Tensor:
    """True where a query may attend (key position <= query position). Made on the CPU whatever the
    default device, so every device starts from the same buffer; it moves with the model."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device="cpu").tril()


def split_heads(t: torch.Tensor, head_size: int) -> torch.Tensor:
    """(batch, seq, local heads * head_size) -> (batch, local heads, seq, head_size). The head count
    comes from the width, so a column-parallel shard (fewer heads) runs the same code."""
    batch, seq, _ = t.shape
    return t.view(batch, seq, -1, head_size).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_size) -> (batch, seq, heads * head_size), as transformers' reshape."""
    batch, _, seq, _ = t.shape
    return t.transpose(1, 2).reshape(batch, seq, -1).contiguous()


def attention_scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """q @ k^T * scale with the future masked out. transformers adds the dtype's minimum instead of
    writing -inf; after the softmax both give exactly 0 there (exp underflows), and a causal row
    always keeps its diagonal, so the probabilities are the same."""
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * scale
    return scores.masked_fill(~mask[:seq, :seq], float("-inf"))


class CheckpointedBlock(nn.Module):
    """A residual block whose ``_forward`` is recomputed in backward when checkpointing is on."""

    def __init__(self, checkpointing: str):
        super().__init__()
        self.checkpointing = checkpointing == "blocks"

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
        raise NotImplementedError


class CausalLM(nn.Module):
    """forward = embed -> blocks -> head, the contract the pipeline stages rely on. Subclasses hold
    their parameters only in top-level children, in forward order: the modules ``EMBEDDINGS`` names
    (the first pipeline stage keeps them), ``blocks``, then those ``HEAD`` names (the last stage's);
    they define ``_embed``."""

    EMBEDDINGS: tuple[str, ...] = ("tok_emb",)
    HEAD: tuple[str, ...] = ("ln_f", "lm_head")

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.seq_len={self.cfg.seq_len}")
        return self._embed(tokens)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for ``tokens`` (batch, seq); with ``targets``, the mean cross-entropy loss."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return lm_loss(logits, targets)

    def _init_and_tie(self) -> None:
        """normal(0, 0.02) Linear/Embedding weights, zero biases (norms keep their ones/zeros); then
        the tie, so the shared weight holds the embedding's draw (drawn once)."""
        self.apply(init_weights)
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over every position, in float32 (transformers' ForCausalLMLoss upcasts
    the logits too)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def seeded(make, cfg, seed: int) -> nn.Module:
    """``make(cfg)`` with weights depending only on ``seed`` (global RNG untouched), drawn on the CPU
    whatever the default device, so every device starts from the same bytes."""
    fork = torch.random.fork_rng(devices=[])
    with fork, torch.device("cpu"):
        torch.manual_seed(seed)
        return make(cfg)
