"""MiniGPT: a GPT-style decoder small enough to train on 4 CPU ranks in seconds.

nanoGPT's shape: token + learned position embeddings, pre-LayerNorm blocks of
causal multi-head self-attention and a GELU MLP, a final LayerNorm, and an LM
head that is a separate Linear (not tied to the embedding). Attention uses the
explicit masked path (scores, -inf above the diagonal, softmax) so every rank
and every parallel layout runs the same arithmetic.

The modules, the forward and the tensor-parallel plan are GPT-2's (``gpt2.py``); MiniGPT differs
in four class attributes: the GELU, the scores' scaling, the LM head's bias, no embedding dropout.
"""

from __future__ import annotations

import torch.nn.functional as F

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import gpt2
from distlib.app.model.layers import seeded


class MiniGPT(gpt2.GPT2):
    """GPT-2's modules and forward with the capstone's own arithmetic, which its golden losses pin
    bit for bit (the GELU and the scaling round differently from GPT-2's)."""

    ACTIVATION = staticmethod(F.gelu)  # the exact (erf) GELU, not gelu_new's tanh formula
    DIVIDE_SCORES = True  # scores / sqrt(head_dim), not * head_dim**-0.5
    HEAD_BIAS = True  # the LM head has a bias (never tied: model.tie_embeddings is refused)
    EMBEDDING_DROPOUT = False


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


# Megatron's split of a block, GPT-2's: the modules are the same.
TENSOR_PARALLEL_PLAN = gpt2.TENSOR_PARALLEL_PLAN
