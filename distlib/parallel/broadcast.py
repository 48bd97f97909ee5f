"""Data parallelism's first promise: every rank starts from rank 0's weights.

Wrapping a module broadcasts its parameters and buffers from rank 0, once, at
construction, as one flat message. Gradient synchronisation is not here: it is
part of the optimizer step (``distlib.zero``), which for stage 0 all-reduces the
gradients and for stages 1-3 reduce-scatters them.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from distlib.comm import collectives
from distlib.comm.group import Comm


def broadcast_module_(module: nn.Module, comm: Comm, src: int = 0) -> None:
    """Overwrite every parameter and buffer with ``src``'s values, in one broadcast per dtype."""
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):  # same order on every rank
        group = by_dtype[dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        collectives.broadcast(flat, src, comm)
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class DataParallel(nn.Module):
    """A module whose replicas agree at construction; forward is the wrapped module's."""

    def __init__(self, module: nn.Module, comm: Comm):
        super().__init__()
        self.module = module
        self.comm = comm
        with torch.no_grad():
            broadcast_module_(module, comm)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
