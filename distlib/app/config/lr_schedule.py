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

from distlib.app.config.groups import OptimizerConfig


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """The learning rate of ``step`` (1-based) out of ``total_steps`` (``cfg.lr`` is the peak)."""
    lr = cfg.lr
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return lr
    low = lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        span = total_steps - cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / span) if span > 0 else 1.0
        return low + (lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_from = total_steps - cfg.decay_steps  # wsd
    if step <= decay_from:
        return lr
    return low + (lr - low) * max(0, total_steps - step) / cfg.decay_steps
