"""The four ZeRO stages, each the optimizer of one parameter group over its ranks (``StageOptimizer``).

Only this module knows them all; ``optimizer.ZeroOptimizer`` runs one per parameter group, and a
test of one stage's mechanics builds it here (``stage_optimizer``).
"""

from __future__ import annotations

import torch.nn as nn

from distlib.comm.group import Comm
from distlib.parallel.adamw import AdamWConfig
from distlib.parallel.zero.base import StageOptimizer
from distlib.parallel.zero.stage0 import Stage0Optimizer
from distlib.parallel.zero.stage1 import Stage1Optimizer
from distlib.parallel.zero.stage2 import Stage2Optimizer
from distlib.parallel.zero.stage3 import Stage3Optimizer

STAGES = {0: Stage0Optimizer, 1: Stage1Optimizer, 2: Stage2Optimizer, 3: Stage3Optimizer}


def check_stage(stage: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"zero.stage must be one of {tuple(STAGES)}, got {stage}")


def stage_optimizer(
    module: nn.Module, comm: Comm, stage: int, cfg: AdamWConfig, grad_clip: float = 0.0, **options
) -> StageOptimizer:
    """The ZeRO ``stage`` optimizer of ``module``'s parameters (``names``: some of them) over
    ``comm``; ``options`` are ``StageOptimizer``'s keywords (``zero.make_optimizer``'s)."""
    check_stage(stage)
    return STAGES[stage](module, comm, cfg, grad_clip, **options)
