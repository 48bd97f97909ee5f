"""ZeRO stage 2: the gradients are sharded too.

Every rank holds all parameters but, besides its partition of the optimizer state (as at stage
1), only its fp32 partition of the gradients. The gradients are reduce-scattered during backward,
in buckets of whole modules packed in backward order up to ``bucket_numel`` elements, from
post-accumulate-grad hooks (``buckets.GradBuckets``): full gradients never persist. So by the
time backward returns the partition is reduced, and ``sync_grads`` only checks that every bucket
was reduced once per micro-batch. ``apply_update`` runs AdamW on the master partition and
all-gathers the parameters, as stage 1 does.

With ``overlap`` the hook hands the bucket's reduce-scatter to the communication thread and
returns, so backward goes on computing while it runs; ``sync_grads`` waits for the last one.

With K micro-batches each backward reduce-scatters again and accumulates into the partition, so
gradient memory stays 4P/N at the price of K reduce-scatters per step.
"""

from __future__ import annotations

import torch

from distlib.comm import collectives
from distlib.parallel.zero.base import StageOptimizer
from distlib.parallel.zero.buckets import GradBuckets, buckets_by_size


class Stage2Optimizer(StageOptimizer):
    stage = 2

    def _init_storage(self, fp32_flat: torch.Tensor) -> None:
        self._replicated_params(fp32_flat)
        self._partitioned_state(fp32_flat)
        self.grads = GradBuckets(
            self.layout,
            self.params,
            self.comm,
            buckets_by_size(self.module, self.params, self.layout, self.bucket_numel, self.segments),
            self._sample_memory,
            progress=self.progress,
        )
        self.grad_home = self.grads.partition

    def _grad_storage(self) -> list[torch.Tensor]:
        return self.grads.live()

    def _reduce_grads(self) -> torch.Tensor:
        partition = self.grads.collect(self.stage)
        self._sample_memory()
        return partition

    def _publish_params(self) -> None:
        self.flat_params[self.my_range].copy_(self.master)
        collectives.all_gather(self.flat_params, self.flat_params[self.my_range], self.comm)

    def memory_formula(self) -> dict[str, tuple[float, float, str]]:
        """params bP, grads 4P/N, Adam 12P/N; the gradients' allowance is what ``predict`` says the
        buckets and one parameter's gradient add at their peak (with the padded tail): the
        buckets open at once in backward order, and with overlap the one still being reduced."""
        s = self._sizes()
        peaks = self._predicted_peaks()
        return {
            "params": (s.b * s.p, s.b * s.pad, f"{s.b}P"),
            "grads": (4 * s.p / s.n, peaks.grads - 4 * s.p / s.n, "4P/N + bucket"),
            "optimizer": (12 * s.p / s.n, 12 * s.pad / s.n, "12P/N"),
        }
