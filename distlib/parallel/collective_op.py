"""An autograd Function from a collective and the one its backward runs.

Every parallel dimension moves activations between ranks with a pair of collectives that undo
each other's layout: gather the sequence forward, keep this rank's part of the gradient backward;
all-to-all one way, the other way back. ``collective_function`` builds that Function from the
pair, so each dimension states only the pair.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distlib.comm.group import Comm

Op = Callable[[torch.Tensor, Comm], torch.Tensor]


def collective_function(name: str, forward: Op, backward: Op) -> type[torch.autograd.Function]:
    """A Function whose ``apply(x, comm)`` is ``forward(x, comm)`` and whose gradient is
    ``backward(grad, comm)`` (the group gets no gradient)."""

    def run(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return forward(x, comm)

    def back(ctx, grad: torch.Tensor):
        return backward(grad, ctx.comm), None

    return type(
        name, (torch.autograd.Function,), {"forward": staticmethod(run), "backward": staticmethod(back)}
    )
