"""zero: AdamW whose memory is sharded over the data-parallel ranks, one module per ZeRO stage.

Stage 0 (``stage0``) shards nothing (plain DDP: all-reduce the gradients, every rank updates
everything); stage 1 shards the optimizer state (fp32 master + Adam moments, 12P/N bytes);
stage 2 also the gradients (reduce-scattered in buckets during backward, ``buckets``); stage 3
also the parameters (gathered one unit at a time around its forward and backward). Every stage
is a ``base.ZeroOptimizer`` and follows its protocol: ``sync_grads()`` averages the gradients
and returns the global grad norm (``norms``), then ``apply_update(lr)`` clips, runs AdamW on the
master partition and publishes the parameters; the split lets the caller veto an update after
seeing the norm and the loss. Checkpoints hold partition r of the same three fp32 tensors
(``adamw.STATE_KEYS``) at every stage; memory is measured from the live tensors (``memory``).
Parameters averaged over different sets of ranks (experts) are ``groups.ParamGroup``s, one stage
optimizer each, joined by ``groups.GroupedOptimizer`` into one norm and one update.
Rule: the stages share the base and its components (``norms``, ``memory``, ``flat_grads``,
``buckets``); no stage builds on another stage, and only this module knows them all.
"""

from __future__ import annotations

import torch.nn as nn

from distlib.comm.group import Comm
from distlib.parallel.adamw import AdamWConfig
from distlib.parallel.zero.base import ZeroOptimizer
from distlib.parallel.zero.stage0 import Stage0Optimizer
from distlib.parallel.zero.stage1 import Stage1Optimizer
from distlib.parallel.zero.stage2 import Stage2Optimizer
from distlib.parallel.zero.stage3 import Stage3Optimizer

STAGES = {0: Stage0Optimizer, 1: Stage1Optimizer, 2: Stage2Optimizer, 3: Stage3Optimizer}

__all__ = ["STAGES", "ZeroOptimizer", "make_optimizer"]


def make_optimizer(
    module: nn.Module, comm: Comm, stage: int, cfg: AdamWConfig, grad_clip: float = 0.0, **options
) -> ZeroOptimizer:
    """The ZeRO ``stage`` optimizer of ``module`` over the data-parallel group ``comm``; ``options`` are
    ``ZeroOptimizer``'s keywords: ``tp``: the tensor-parallel group, ``tp_split``: names of the
    parameters split over it (both only for the global norms); ``pp``: the pipeline group (the norms
    span every stage). ``bucket_numel`` sizes stage 2's gradient buckets (and, with ``overlap``, stage
    0/1's). ``overlap``: start the gradient sync from backward hooks on a communication thread (stage 3:
    and prefetch the next unit); ``grad_accum``: the backward passes per step (with overlap, stages 0/1
    sync from the last one's hooks)."""
    if stage not in STAGES:
        raise ValueError(f"zero.stage must be one of {tuple(STAGES)}, got {stage}")
    return STAGES[stage](module, comm, cfg, grad_clip, **options)
