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


# torch.utils.checkpoint's non-reentrant path reads torch._dynamo.config at every call, and the first
# read imports torch._dynamo: 2.1 s of wall time and as much CPU per process on 2 cores (AMD EPYC).
# A launcher that forks its workers imports it once, before the fork, instead of every worker.
_RECOMPUTE_IMPORTS = ("torch._dynamo",)


def imports(activation_checkpointing: str) -> tuple[str, ...]:
    """The modules a worker imports at its first recomputed block under this setting (none without
    recomputation)."""
    return () if activation_checkpointing == "none" else _RECOMPUTE_IMPORTS
