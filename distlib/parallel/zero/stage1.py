"""ZeRO stage 1: the optimizer state is sharded.

Every rank holds all parameters and all gradients (one fp32 flat buffer, ``flat_grads``, as at
stage 0), but only its partition of the fp32 master weights and Adam moments: 12P/N bytes
instead of 8-12P. ``sync_grads`` reduce-scatters the flat gradients (avg), once per step (with
``overlap``, in buckets from the last backward's hooks: ``overlap.OverlappedSync``), so
each rank receives the averaged gradient of its partition; ``apply_update`` runs AdamW on the
master partition, writes it into the parameters (compute dtype) and all-gathers the parameters,
after which every rank again holds identical bytes.
"""

from __future__ import annotations

import torch

from distlib.comm import collectives
from distlib.parallel.zero.base import StageOptimizer


class Stage1Optimizer(StageOptimizer):
    stage = 1

    def _init_storage(self, fp32_flat: torch.Tensor) -> None:
        self._replicated_params(fp32_flat)
        self._replicated_grads(scatter=True)
        self._partitioned_state(fp32_flat)

    @torch.no_grad()
    def _reduce_grads(self) -> torch.Tensor:
        self._sample_memory()
        if self.overlapped is not None:  # started in backward: wait for it
            return self.overlapped.finish()
        return collectives.reduce_scatter(self.flat_grads, self.comm, op="avg")

    def _publish_params(self) -> None:
        self.flat_params[self.my_range].copy_(self.master)
        collectives.all_gather(self.flat_params, self.flat_params[self.my_range], self.comm)

    def memory_formula(self) -> dict[str, tuple[float, float, str]]:
        """params bP, grads 4P (+ one bf16 gradient in a hook), Adam 12P/N; allowances: the padded
        tail (< N elements)."""
        s = self._sizes()
        return {
            "params": (s.b * s.p, s.b * s.pad, f"{s.b}P"),
            "grads": (4 * s.p, 4 * s.pad + s.bf16_grad, "4P"),
            "optimizer": (12 * s.p / s.n, 12 * s.pad / s.n, "12P/N"),
        }
