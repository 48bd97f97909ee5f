"""Small GPT-2, Llama and Qwen3 configs and helpers shared by the family and Hugging Face tests."""

from __future__ import annotations

from dataclasses import replace

import torch

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import families

# Small, varied shapes: tied and untied heads, grouped-query (and multi-query) attention, an MLP
# width that is no multiple of dim, a non-default norm eps and RoPE theta.
GPT2_TIED = ModelConfig(
    family="gpt2", vocab_size=64, seq_len=16, dim=32, n_heads=4, n_layers=2, tie_embeddings=True
)
GPT2_UNTIED = ModelConfig(
    family="gpt2", vocab_size=70, seq_len=20, dim=48, n_heads=6, n_layers=2, mlp_hidden=100, norm_eps=1e-6
)
LLAMA_GQA = ModelConfig(
    family="llama",
    vocab_size=64,
    seq_len=16,
    dim=32,
    n_heads=4,
    n_kv_heads=2,
    n_layers=2,
    mlp_hidden=80,
    norm_eps=1e-6,
    rope_theta=500.0,
)
LLAMA_TIED = ModelConfig(
    family="llama", vocab_size=50, seq_len=24, dim=64, n_heads=4, n_layers=2, tie_embeddings=True, mlp_ratio=3
)
LLAMA_ODD = ModelConfig(
    family="llama",
    vocab_size=77,
    seq_len=32,
    dim=48,
    n_heads=6,
    n_kv_heads=1,
    n_layers=2,
    mlp_hidden=88,
    norm_eps=1e-6,
)
# heads wider than dim / n_heads (dim 36 does not even divide by 4 heads): q/k/v project to 4 x 16
LLAMA_HEAD_DIM = ModelConfig(
    family="llama", vocab_size=60, seq_len=16, dim=36, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2
)
QWEN3_GQA = ModelConfig(
    family="qwen3",
    vocab_size=64,
    seq_len=16,
    dim=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    n_layers=2,
    mlp_hidden=80,
    norm_eps=1e-6,
    rope_theta=1000.0,
)
QWEN3_TIED = ModelConfig(
    family="qwen3", vocab_size=50, seq_len=24, dim=48, n_heads=4, n_layers=2, tie_embeddings=True
)
CONFIGS = {
    "gpt2-tied": GPT2_TIED,
    "gpt2-untied": GPT2_UNTIED,
    "llama-gqa": LLAMA_GQA,
    "llama-tied": LLAMA_TIED,
    "llama-odd": LLAMA_ODD,
    "llama-head-dim": LLAMA_HEAD_DIM,
    "qwen3-gqa": QWEN3_GQA,
    "qwen3-tied": QWEN3_TIED,
}


def canonical(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` as an import states it: n_kv_heads null when it equals n_heads, the MLP width as
    mlp_ratio when it is a multiple of dim (else mlp_hidden, mlp_ratio at its default)."""
    kv = None if cfg.kv_heads == cfg.n_heads else cfg.kv_heads
    width = cfg.mlp_width
    mlp = (
        dict(mlp_ratio=width // cfg.dim, mlp_hidden=None)
        if width % cfg.dim == 0
        else dict(mlp_ratio=4, mlp_hidden=width)
    )
    return replace(cfg, n_kv_heads=kv, **mlp)


def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """Add seeded noise to every parameter: the zero biases and unit norm weights of a fresh model
    would hide a bias or norm mapped to the wrong place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # a tied weight is listed (and perturbed) once
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def built(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    return perturb_(families.build(cfg, seed), seed + 1000).eval()


def tokens(cfg: ModelConfig, batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def quiet_transformers():
    """transformers (the test is skipped without it), its progress bars off and the tokenizers'
    thread pool unused: from_pretrained's bar starts tqdm's monitor thread and an encode starts
    the pool's threads, which outlive the test (tests/conftest.py refuses that)."""
    import os

    import pytest

    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    return transformers
