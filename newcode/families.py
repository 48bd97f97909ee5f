"""The model families by name: build, tensor-parallel plan and layout check, parameter count.

    family    class                       computes what
    minigpt   distlib.app.model.MiniGPT   (the project's own model)
    gpt2      gpt2.GPT2                   transformers' GPT2LMHeadModel
    llama     llama.Llama                 transformers' LlamaForCausalLM

Every family follows one contract (the trainer, ZeRO-3 and the pipeline stages rely on it):
``forward(tokens, targets=None)`` = embed -> blocks -> head; parameters only in the top-level
children tok_emb [, pos_emb], blocks, ln_f, lm_head, in forward order; a module-level
TENSOR_PARALLEL_PLAN; blocks with a ``checkpointing`` flag.
"""
from __future__ import annotations

import math

import torch.nn as nn

import gpt2
import llama
from layers import ModelConfig, kv_heads, mlp_width  # noqa: F401  (ModelConfig re-exported)

FAMILIES = ("minigpt", "gpt2", "llama")


def _minigpt_module():
    # Imported only when asked for: the project's own model lives in distlib/app.
    from distlib.app import model as minigpt
    return minigpt


def _family(cfg):
    if cfg.family == "gpt2":
        return gpt2
    if cfg.family == "llama":
        return llama
    if cfg.family == "minigpt":
        return None
    raise ValueError(f"model.family must be one of {list(FAMILIES)}, got {cfg.family!r}")


def build(cfg, seed: int) -> nn.Module:
    """The model of ``cfg.family`` with weights depending only on ``seed`` (global RNG untouched)."""
    module = _family(cfg)
    if module is None:
        return _minigpt_module().build_model(cfg, seed)   # MiniGPT reads only fields this config has
    return module.build(cfg, seed)


def tensor_parallel_plan(cfg) -> dict:
    module = _family(cfg)
    return (module or _minigpt_module()).TENSOR_PARALLEL_PLAN


def check_tp(cfg, tp: int) -> None:
    """Raise ValueError (one line) unless every split dimension of ``cfg`` divides by ``tp``."""
    _family(cfg)
    if cfg.n_heads % tp:
        raise ValueError(f"dist.tp={tp} must divide model.n_heads={cfg.n_heads} (attention heads are split "
                         f"across tensor-parallel ranks)")
    if cfg.family == "llama" and kv_heads(cfg) % tp:
        raise ValueError(f"dist.tp={tp} must divide model.n_kv_heads={kv_heads(cfg)} (key/value heads are "
                         f"split across tensor-parallel ranks)")
    width = cfg.mlp_ratio * cfg.dim if cfg.family == "minigpt" else mlp_width(cfg)
    if width % tp:
        name = "model.mlp_hidden" if cfg.family != "minigpt" and cfg.mlp_hidden is not None else \
            "the MLP width (model.mlp_ratio * model.dim)"
        raise ValueError(f"dist.tp={tp} must divide {name}={width} (MLP hidden units are split across "
                         f"tensor-parallel ranks)")


def _minigpt_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """MiniGPT's state_dict shapes: GPT-2's layout at mlp_ratio * dim, plus the LM head's bias."""
    shapes = gpt2.param_shapes(ModelConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, dim=cfg.dim,
                                           n_heads=cfg.n_heads, n_layers=cfg.n_layers,
                                           mlp_ratio=cfg.mlp_ratio))
    return shapes | {"lm_head.bias": (cfg.vocab_size,)}


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every state_dict entry's shape, in order (a tied lm_head.weight listed too)."""
    module = _family(cfg)
    return _minigpt_shapes(cfg) if module is None else module.param_shapes(cfg)


def param_count(cfg) -> int:
    """The number of parameters of the whole (unsplit) model, tied weights counted once."""
    tied = cfg.family != "minigpt" and cfg.tie_embeddings
    return sum(math.prod(shape) for name, shape in param_shapes(cfg).items()
               if not (tied and name == "lm_head.weight"))
