"""ZeRO stage 0: nothing sharded (plain data parallelism).

Every rank holds all parameters, all gradients (one fp32 flat buffer, ``flat_grads``) and the
whole AdamW state. ``sync_grads`` all-reduces the flat gradients (SUM / N), once per step
whatever the number of micro-batches (with ``overlap``, in buckets from the last backward's
hooks: ``overlap.OverlappedSync``), and every rank runs the identical AdamW update on
everything, so the replicas stay bitwise equal without sending parameters. fp32 parameters are
their own master weights; bf16 ones get an fp32 master copy.

Checkpoints still hold partition r of (master, exp_avg, exp_avg_sq) on rank r (the format of
every stage); loading copies the partition in and all-gathers the rest.
"""

from __future__ import annotations

import torch

from distlib.comm import collectives
from distlib.parallel.zero.base import StageOptimizer


class Stage0Optimizer(StageOptimizer):
    stage = 0
    whole_grads = True  # every rank updates everything from the all-reduced gradients

    def _init_storage(self, fp32_flat: torch.Tensor) -> None:
        self._replicated_params(fp32_flat)
        self._replicated_grads(scatter=False)
        self.master = fp32_flat.clone() if self.low_precision else self.flat_params
        self.exp_avg = torch.zeros(self.layout.padded_numel, device=self.device)
        self.exp_avg_sq = torch.zeros(self.layout.padded_numel, device=self.device)

    @torch.no_grad()
    def _reduce_grads(self) -> torch.Tensor:
        self._sample_memory()
        if self.overlapped is not None:  # started in backward: wait for it
            return self.overlapped.finish()
        return collectives.all_reduce(self.flat_grads, self.comm, op="avg")

    def _mine(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.my_range]

    def _load_state(self, key: str, partition: torch.Tensor) -> None:
        mine = self._mine(getattr(self, key))
        mine.copy_(partition)
        collectives.all_gather(getattr(self, key), mine, self.comm)

    def _publish_params(self) -> None:
        if self.master is not self.flat_params:
            self.flat_params.copy_(self.master)

    def memory_formula(self) -> dict[str, tuple[float, float, str]]:
        """params bP, grads 4P (+ one bf16 gradient in a hook), Adam 8P in fp32 (the parameters
        are the master) or 12P in bf16; allowances: the padded tail (< N elements)."""
        s = self._sizes()
        opt = 8 if s.b == 4 else 12
        return {
            "params": (s.b * s.p, s.b * s.pad, f"{s.b}P"),
            "grads": (4 * s.p, 4 * s.pad + s.bf16_grad, "4P"),
            "optimizer": (opt * s.p, opt * s.pad, f"{opt}P"),
        }
