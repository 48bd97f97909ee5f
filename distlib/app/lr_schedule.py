"""The learning rate of each step: a pure function of the step number (``optimizer.schedule``).

Because the rate depends on nothing but the step, a resumed run (whose checkpoint carries the
step) continues the schedule exactly, with no scheduler state to save. Steps count from 1 to
``train.steps`` (T); W = ``warmup_steps``, D = ``decay_steps``, lr_min = ``min_lr_ratio`` x lr::

    warmup (any schedule)  step <= W:  lr * step / W          (linear, reaching lr at step W)
    constant               lr
    cosine                 lr_min + (lr - lr_min) * (1 + cos(pi * (step - W) / (T - W))) / 2
    wsd                    warmup, stable at lr, then the last D steps decay linearly to lr_min:
                           lr_min + (lr - lr_min) * (T - step) / D   for step > T - D

At the default (constant, no warmup) ``lr_at`` returns the configured float itself, so the update
is bit for bit the one of a run without schedules.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("constant", "cosine", "wsd")
KEYS = ("schedule", "warmup_steps", "decay_steps", "min_lr_ratio")   # keys of the optimizer group


@dataclass(frozen=True)
class ScheduleConfig:
    schedule: str = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0        # wsd only: the final decay phase
    min_lr_ratio: float = 0.0   # cosine / wsd: the rate they decay to, as a fraction of optimizer.lr

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optimizer.schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        for name in ("warmup_steps", "decay_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"optimizer.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.schedule == "wsd" and self.decay_steps < 1:
            raise ValueError("optimizer.schedule=wsd needs optimizer.decay_steps >= 1 (its final decay phase)")
        if self.schedule != "wsd" and self.decay_steps:
            raise ValueError(f"optimizer.decay_steps is used by schedule=wsd only (schedule={self.schedule}; "
                             f"cosine decays from the end of warmup to train.steps)")


def lr_at(step: int, lr: float, cfg: ScheduleConfig, total_steps: int) -> float:
    """The learning rate of ``step`` (1-based) out of ``total_steps``, for base rate ``lr``."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return lr
    low = lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        span = total_steps - cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / span) if span > 0 else 1.0
        return low + (lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_from = total_steps - cfg.decay_steps          # wsd
    if step <= decay_from:
        return lr
    return low + (lr - low) * max(0, total_steps - step) / cfg.decay_steps
