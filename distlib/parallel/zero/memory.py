"""Memory of a ZeRO optimizer, measured and predicted.

``PeakMemory`` is the measurement: the peak, over the run, of the bytes of the live tensors in
each category (params, grads, optimizer), where a tensor's bytes are its storage's and a storage
shared by several tensors (a view, the fp32 parameters that are their own master) counts once.
The stages sample where their tensors peak: in the gradient hooks, around each gather, before and
after the update. ``Sizes`` holds the numbers the per-stage formulas (``memory_formula`` of each
stage, docs/parallelism.md) are written in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlib.parallel.flat_layout import FlatLayout

CATEGORIES = ("params", "grads", "optimizer")


class PeakMemory:
    def __init__(self) -> None:
        self._peak = dict.fromkeys(CATEGORIES, 0)

    def sample(self, live: dict[str, list[torch.Tensor]]) -> None:
        """Record the bytes of ``live`` (category -> tensors, in CATEGORIES order) if they peak."""
        seen: set[int] = set()
        for category, tensors in live.items():
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen or storage.nbytes() == 0:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            self._peak[category] = max(self._peak[category], total)

    def peaks(self) -> dict[str, int]:
        return dict(self._peak)


@dataclass(frozen=True)
class Sizes:
    """P parameters, N data-parallel ranks, b bytes per parameter in the compute dtype (4 fp32,
    2 bf16), the padding (< N elements) and the largest single parameter."""

    p: int
    n: int
    b: int
    pad: int
    largest_param: int

    @staticmethod
    def of(layout: FlatLayout, param_dtype: torch.dtype) -> Sizes:
        return Sizes(
            p=layout.numel,
            n=layout.world_size,
            b=param_dtype.itemsize,
            pad=layout.padded_numel - layout.numel,
            largest_param=max(s.numel for s in layout.slots),
        )

    @property
    def bf16_grad(self) -> int:
        """In a low-precision run, one parameter's gradient in the compute dtype lives for the
        duration of the hook that folds it into the fp32 buffer (none in fp32: autograd
        accumulates straight into the fp32 buffer)."""
        return self.b * self.largest_param if self.b != 4 else 0
