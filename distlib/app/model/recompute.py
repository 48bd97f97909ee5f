"""Whether the forward running now is activation checkpointing's recomputation in backward.

A block under ``model.activation_checkpointing=blocks`` runs its forward twice in a step: once in
the forward, once in backward to rebuild what it did not keep. What a forward counts for the step
(an MoE's tokens per expert, ``moe.MoE``) must be counted once: ``PreNormBlock`` enters
``recomputing()`` around the second run (torch's checkpoint ``context_fn``), and a counter asks
``is_recomputing()``.
"""

from __future__ import annotations

import contextlib
import contextvars

_RECOMPUTING = contextvars.ContextVar("recomputing", default=False)


@contextlib.contextmanager
def recomputing():
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def is_recomputing() -> bool:
    return _RECOMPUTING.get()


def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's ``context_fn``: nothing around the forward, ``recomputing`` around
    the recomputation."""
    return contextlib.nullcontext(), recomputing()
