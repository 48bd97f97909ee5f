"""The gradients of stages 0 and 1: one fp32 buffer holding every parameter's gradient.

In fp32 each parameter's ``.grad`` is a view into the buffer, so autograd accumulates straight
into it and K micro-batches need no extra copy. With a low-precision compute dtype a
post-accumulate-grad hook adds the parameter's fresh bf16 gradient into the fp32 buffer and drops
it, so gradients are accumulated (and later reduced) in fp32. The buffer is synchronised once per
step, after the last micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from distlib.parallel.flat_layout import FlatLayout, ParamSlot


def flat_grad_buffer(
    layout: FlatLayout, params: Sequence[torch.Tensor], low_precision: bool, sample: Callable[[], None]
) -> torch.Tensor:
    """A zeroed fp32 buffer of ``layout.padded_numel`` that the parameters' gradients accumulate
    into; ``sample`` runs in each low-precision hook, while the bf16 gradient is still alive."""
    flat = torch.zeros(layout.padded_numel, device=params[0].device)
    for slot, p in zip(layout.slots, params):
        if low_precision:
            p.grad = None
            p.register_post_accumulate_grad_hook(_accumulate_hook(flat, slot, sample))
        else:
            p.grad = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
    return flat


def _accumulate_hook(flat: torch.Tensor, slot: ParamSlot, sample: Callable[[], None]):
    def hook(p: torch.Tensor) -> None:
        flat[slot.offset : slot.offset + slot.numel].add_(p.grad.reshape(-1))
        sample()
        p.grad = None

    return hook
