"""zero: AdamW whose memory is sharded over the data-parallel ranks, one module per ZeRO stage.

Stage 0 (``stage0``) shards nothing (plain DDP: all-reduce the gradients, every rank updates
everything); stage 1 shards the optimizer state (fp32 master + Adam moments, 12P/N bytes);
stage 2 also the gradients (reduce-scattered in buckets during backward, ``buckets``); stage 3
also the parameters (gathered one unit at a time around its forward and backward). Every stage
is a ``base.StageOptimizer`` and follows its protocol: ``sync_grads()`` averages the gradients
and returns the global grad norm (``norms``), then ``apply_update(lr)`` clips, runs AdamW on the
master partition and publishes the parameters; the split lets the caller veto an update after
seeing the norm and the loss. Checkpoints hold partition r of the same three fp32 tensors
(``adamw.STATE_KEYS``) at every stage; memory is measured from the live tensors (``memory``).

The one optimizer a run uses is ``optimizer.ZeroOptimizer``: ZeRO over parameter groups
(``optimizer.ParamGroup``), one stage optimizer each, joined into one norm and one update. A
dense model is one group over the data-parallel ranks (``make_optimizer``); experts add a second.
Rule: the stages share the base and its components (``norms``, ``memory``, ``flat_grads``,
``buckets``); no stage builds on another stage, and only ``stages`` knows them all.
"""

from __future__ import annotations

import torch.nn as nn

from distlib.comm.group import Comm
from distlib.parallel.adamw import AdamWConfig
from distlib.parallel.zero.optimizer import ParamGroup, ZeroOptimizer

__all__ = ["ParamGroup", "ZeroOptimizer", "make_optimizer"]

PARAMS = "params"  # the one group of a model whose parameters are all averaged over the same ranks


def make_optimizer(
    module: nn.Module, comm: Comm, stage: int, cfg: AdamWConfig, grad_clip: float = 0.0, **options
) -> ZeroOptimizer:
    """The ZeRO ``stage`` optimizer of ``module`` over the data-parallel group ``comm`` (one parameter
    group); ``options`` are ``StageOptimizer``'s keywords: ``tp``: the tensor-parallel group,
    ``tp_split``: names of the parameters split over it (both only for the global norms); ``pp``: the
    pipeline group (the norms span every stage). ``bucket_numel`` sizes stage 2's gradient buckets
    (and, with ``overlap``, stage 0/1's). ``overlap``: start the gradient sync from backward hooks on
    a communication thread (stage 3: and prefetch the next unit); ``grad_accum``: the backward passes
    per step (with overlap, stages 0/1 sync from the last one's hooks)."""
    names = tuple(n for n, _ in module.named_parameters())
    return ZeroOptimizer(module, [ParamGroup(PARAMS, names, comm)], stage, cfg, grad_clip, **options)
