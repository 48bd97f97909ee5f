"""What a planning group's collectives and messages would have moved (``Comm.dry``: they move
nothing), for the planner's step-time prediction: inside ``tallied()`` every outermost collective
of a dry group of two or more ranks, and every point-to-point send on one, is noted as
``(kind, bytes, group size)``: the bytes of the whole tensor the collective is called with (what
``cost_model`` prices), of the message for a send (kind ``"send"``). Outside ``tallied()``, or on
a real group, noting costs one context-variable read."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from distlib.comm.group import Comm

_NOTES: contextvars.ContextVar[list[tuple[str, int, int]] | None] = contextvars.ContextVar(
    "distlib_tally", default=None
)


@contextlib.contextmanager
def tallied() -> Iterator[list[tuple[str, int, int]]]:
    """The list the dry groups' calls in this context are appended to, as (kind, bytes, size)."""
    notes: list[tuple[str, int, int]] = []
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)


def note(comm: Comm, kind: str, nbytes: int) -> None:
    """Record one call of ``kind`` moving a tensor of ``nbytes`` on ``comm`` (dry groups only)."""
    notes = _NOTES.get()
    if notes is not None and comm.dry and comm.size > 1:
        notes.append((kind, int(nbytes), comm.size))
