"""The validation loss (``train.eval_every``): the mean per-token loss over the held-out windows.

Each data-parallel rank scores its share of the windows (the tensor-parallel ranks of a group
score it together); the (sum, count) pairs are combined in rank order, so every rank gets the same
value. With ZeRO-3 or tensor parallelism every forward is collective, so all ranks run as many as
the busiest one (the extra ones score nothing). The model is put back in training mode after.
"""

from __future__ import annotations

import torch

from distlib.comm import agree
from distlib.comm.group import Comm


class Validation:
    def __init__(self, every: int, heldout, model: torch.nn.Module, dp: Comm, micro_batch: int, device):
        self.every, self.heldout, self.model, self.dp = every, heldout, model, dp
        self.micro_batch, self.device = micro_batch, device

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    @torch.no_grad()
    def loss(self) -> float:
        """Mean per-token loss over the held-out windows, the same on every rank (collective)."""
        batches = self.heldout.batches(self.dp.rank, self.dp.size, self.micro_batch)
        forwards = int(max(row[0] for row in agree.gather([float(len(batches))], self.dp)))
        idle = torch.zeros(1, self.heldout.seq_len, dtype=torch.int64, device="cpu")
        self.model.eval()
        total, count = 0.0, 0
        try:
            for i in range(forwards):
                inputs, targets = batches[i] if i < len(batches) else (idle, idle)
                loss = float(self.model(inputs.to(self.device), targets.to(self.device)))
                if i < len(batches):
                    total += loss * targets.numel()
                    count += targets.numel()
        finally:
            self.model.train()
        rows = agree.gather([total, float(count)], self.dp)
        return sum(row[0] for row in rows) / sum(row[1] for row in rows)
