"""How a collective's algorithm runs on a group: read from the group's board where its members
share one (``algorithms.reads``: the same sums in the same order), else by messages; a dry group
(``Comm.dry``) runs nothing. Shared by ``collectives`` and ``exchange``."""

from __future__ import annotations

from torch import Tensor

from distlib.comm.algorithms import reads
from distlib.comm.group import Comm


def nothing(*args, **kwargs) -> None:
    """A dry group's collective (``Comm.dry``): the output keeps what it holds."""


def execution(collective: str, name: str, comm: Comm, table: dict):
    """How algorithm ``name`` (a key of ``table``, the message algorithms) runs on ``comm``."""
    if reads.board(comm) is not None:
        return reads.runner(collective, name)
    return table[name]


def flat(t: Tensor) -> Tensor:
    """``t`` as one dimension, without a copy: collectives work on contiguous tensors only."""
    if not t.is_contiguous():
        raise ValueError("collectives need a contiguous tensor")
    return t.view(-1)
