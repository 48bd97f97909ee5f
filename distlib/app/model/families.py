"""The model families by name (``model.family``): build, tensor-parallel plan and split, size.

    family    class              computes what
    minigpt   minigpt.MiniGPT    (the project's own model; the capstone)
    gpt2      gpt2.GPT2          transformers' GPT2LMHeadModel
    llama     llama.Llama        transformers' LlamaForCausalLM
    qwen3     qwen3.Qwen3        transformers' Qwen3ForCausalLM (Llama with per-head q/k norms)
    mixtral   mixtral.Mixtral    transformers' MixtralForCausalLM (Llama with sparse MoE blocks)
    qwen3_moe qwen3_moe.Qwen3Moe transformers' Qwen3MoeForCausalLM (Qwen3's attention, Mixtral's MoE)
    deepseek_v3 deepseek_v3.DeepseekV3 transformers' DeepseekV3ForCausalLM (latent attention,
                                   dense first blocks, shared and routed experts)

Every family follows one contract (``layers.CausalLM``; the trainer, ZeRO-3 and the pipeline
stages rely on it): ``forward(tokens, targets=None, positions=None)`` = embed -> blocks -> head,
the positions handed to the embedding and every block; parameters only in top-level children, in
forward order; a module-level ``TENSOR_PARALLEL_PLAN``; blocks that checkpoint themselves
(``model.activation_checkpointing``). A family whose loss reads the whole batch (mixtral's
load-balancing term) is told its batch group (``join_batch_``) and adds fields to the step record
(``CausalLM.step_fields``).
"""

from __future__ import annotations

import math
from functools import partial

import torch.nn as nn

from distlib.app.config.dimension_rules import check_tensor_parallel
from distlib.app.config.model_group import ModelConfig
from distlib.app.model import deepseek_v3, gpt2, llama, minigpt, mixtral, moe, qwen3, qwen3_moe
from distlib.app.model.layers import CausalLM, seeded
from distlib.app.model.strategies import LOCAL, Strategies
from distlib.comm.group import Comm
from distlib.parallel.tensor_parallel import Split, parallelize_

CLASSES = {
    "minigpt": minigpt.MiniGPT,
    "gpt2": gpt2.GPT2,
    "llama": llama.Llama,
    "qwen3": qwen3.Qwen3,
    "mixtral": mixtral.Mixtral,
    "qwen3_moe": qwen3_moe.Qwen3Moe,
    "deepseek_v3": deepseek_v3.DeepseekV3,
}
PLANS = {
    "minigpt": minigpt.TENSOR_PARALLEL_PLAN,
    "gpt2": gpt2.TENSOR_PARALLEL_PLAN,
    "llama": llama.TENSOR_PARALLEL_PLAN,
    "qwen3": qwen3.TENSOR_PARALLEL_PLAN,
    "mixtral": mixtral.TENSOR_PARALLEL_PLAN,
    "qwen3_moe": qwen3_moe.TENSOR_PARALLEL_PLAN,
}


def build(cfg: ModelConfig, seed: int, strategies: Strategies = LOCAL) -> CausalLM:
    """The model of ``cfg.family`` with weights depending only on ``seed`` (global RNG untouched),
    drawn on the CPU whatever the default device, built for its layout (``strategies``: how its
    layers reach what other ranks hold; the weights do not depend on them)."""
    return seeded(partial(CLASSES[cfg.family], strategies=strategies), cfg, seed)


def tensor_parallel_plan(cfg: ModelConfig, blocks=None) -> dict:
    """The family's plan for a model (or pipeline stage) holding ``blocks`` (indices; None: all)."""
    if cfg.family == "deepseek_v3":  # its dense and MoE blocks split differently
        return deepseek_v3.tensor_parallel_plan(cfg, range(cfg.n_layers) if blocks is None else blocks)
    return PLANS[cfg.family]


def shard_model_(model: CausalLM, tp: Comm) -> dict[str, Split]:
    """Replace every block's attention and MLP Linear layers with this rank's tensor-parallel shard
    of them (in place, keeping parameter names and order), following the model's sequence
    strategy; returns each split parameter's Split (none with a tensor-parallel group of one). A
    dimension that does not split is a ConfigError. With ``dist.sp`` (a model built with a
    ``SequenceSplit`` over ``tp``) every rank holds only its share of the tokens between those
    layers (``distlib.parallel.sequence_parallel``); the parameters are the same. Some parameters'
    gradients are then each rank's share only (``partial_over_tp``)."""
    check_tensor_parallel(model.cfg, tp.size)
    if model.sequence.parts != 1 and tp.size == 1:
        raise ValueError("sequence parallelism needs a tensor-parallel group of more than one rank")
    plan = tensor_parallel_plan(model.cfg, [i for i, _ in held_blocks(model)])
    return parallelize_(model, tp, plan, model.sequence)


def partial_over_tp(model: CausalLM, tp: Comm) -> tuple[str, ...]:
    """The parameters every tensor-parallel rank holds whole but applies to its own share of the
    work, so that each rank's gradient is that share's and the sum over ``tp`` is the gradient (the
    optimizer takes it once per step, ``parallel.zero.partial_sums``): a module's
    ``head_shared_parameters()`` (qwen3's q/k norms, each rank on its heads) and, with the stream
    split along the sequence (``dist.sp``), its ``sequence_sharded_parameters()`` (norms and row
    biases on the rank's tokens). None at a tensor-parallel group of one."""
    if tp.size == 1:
        return ()
    split = model.sequence.parts > 1
    shares = ["head_shared_parameters"] + (["sequence_sharded_parameters"] if split else [])
    ids = {id(p) for m in model.modules() for kind in shares for p in getattr(m, kind, list)()}
    return tuple(n for n, p in model.named_parameters() if id(p) in ids)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state_dict entry's shape, in order (a tied lm_head.weight listed too)."""
    if cfg.family == "minigpt":  # GPT-2's layout at mlp_ratio x dim, plus the LM head's bias
        return gpt2.param_shapes(cfg) | {"lm_head.bias": (cfg.vocab_size,)}
    modules = {"gpt2": gpt2, "llama": llama, "qwen3": qwen3, "mixtral": mixtral, "qwen3_moe": qwen3_moe}
    modules["deepseek_v3"] = deepseek_v3
    return modules[cfg.family].param_shapes(cfg)


def join_batch_(model: CausalLM, batch: Comm) -> None:
    """Make a model whose loss counts over the whole batch (mixtral's routing) count over ``batch``
    (the dp x cp ranks); other families have nothing to join."""
    if model.cfg.has_experts:
        model.batch = batch


def hold_experts_(model: CausalLM, ep: Comm) -> tuple[str, ...]:
    """Keep only this rank's experts of every MoE block (``dist.ep``: ``ep`` the expert group);
    returns the names of the expert parameters kept (the others' gradients are averaged apart)."""
    if not model.cfg.has_experts:
        raise ValueError(f"expert parallelism needs a model with experts, not {model.cfg.family}")
    for _, layer in moe_blocks(model):
        layer.hold_experts_(ep)
    return tuple(n for n, _ in model.named_parameters() if moe.expert_of(n) is not None)


def held_blocks(model: CausalLM) -> list[tuple[int, nn.Module]]:
    """(index in the whole model, block) of each block this rank holds (a pipeline stage keeps its
    blocks in a ModuleDict by index)."""
    blocks = model.blocks.items() if isinstance(model.blocks, nn.ModuleDict) else enumerate(model.blocks)
    return [(int(i), b) for i, b in blocks]


def moe_blocks(model: CausalLM) -> list[tuple[int, moe.MoE]]:
    """(block index in the whole model, its MoE) for each MoE block this rank holds."""
    return [(i, b.mlp) for i, b in held_blocks(model) if isinstance(b.mlp, moe.MoE)]


def param_count(cfg: ModelConfig) -> int:
    """P of the whole (unsplit) model from its shape alone, tied weights counted once: the sum of
    its parameters' numel, without building one (even on the meta device, nn.init imports
    torch._dynamo: +1.3 s a process)."""
    if cfg.family == "minigpt":
        return minigpt.param_count(cfg)
    return sum(
        math.prod(shape)
        for name, shape in param_shapes(cfg).items()
        if not (cfg.tie_embeddings and name == "lm_head.weight")
    )


def active_param_count(cfg: ModelConfig) -> int:
    """The parameters a token meets (MFU's P): ``param_count`` less, in every MoE block, the routed
    experts it is not sent to (n_experts - top_k of them; a shared expert meets every token). The
    same as ``param_count`` for a dense model."""
    if not cfg.has_experts:
        return param_count(cfg)
    routed = sum(math.prod(shape) for name, shape in param_shapes(cfg).items() if ".mlp.experts." in name)
    return param_count(cfg) - routed // cfg.n_experts * (cfg.n_experts - cfg.top_k)
