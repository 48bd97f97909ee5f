"""Data parallelism's first promise: every rank starts from rank 0's weights.

``broadcast_module_`` overwrites a module's parameters and buffers with rank 0's, once, before
training, as one flat message per dtype. Gradient synchronisation is not here: it is part of the
optimizer step (``distlib.parallel.zero``), which for stage 0 all-reduces the gradients and for
stages 1-3 reduce-scatters them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distlib.comm import collectives
from distlib.comm.group import Comm


@torch.no_grad()
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
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
