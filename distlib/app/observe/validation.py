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
from distlib.parallel.documents import Documents


class Validation:
    def __init__(
        self, every: int, heldout, model: torch.nn.Module, dp: Comm, micro_batch: int, device, ends=None
    ):
        self.every, self.heldout, self.model, self.dp = every, heldout, model, dp
        self.micro_batch, self.device = micro_batch, device
        self.ends = ends  # data.document_mask: the end-of-document token (the windows are packed too)
        self.by_source: list[float] = []

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    @torch.no_grad()
    def loss(self) -> float:
        """Mean per-token loss over the held-out windows, the same on every rank (collective); with
        several sources (``data.mixture``) each one's mean is kept in ``by_source``."""
        batches = self.heldout.sourced_batches(self.dp.rank, self.dp.size, self.micro_batch)
        forwards = int(max(row[0] for row in agree.gather([float(len(batches))], self.dp)))
        idle = torch.zeros(1, self.heldout.seq_len, dtype=torch.int64, device="cpu")
        self.model.eval()
        sums = [0.0, 0.0] * self.heldout.sources  # (loss x tokens, tokens) of each source
        try:
            for i in range(forwards):
                source, inputs, targets = batches[i] if i < len(batches) else (None, idle, idle)
                documents = Documents.packed(inputs, self.ends, self.device)
                loss = float(
                    self.model(inputs.to(self.device), targets.to(self.device), None, None, documents)
                )
                if source is not None:
                    sums[2 * source] += loss * targets.numel()
                    sums[2 * source + 1] += targets.numel()
        finally:
            self.model.train()
        rows = agree.gather(sums, self.dp)
        totals = [sum(row[k] for row in rows) for k in range(len(sums))]
        self.by_source = [totals[k] / totals[k + 1] for k in range(0, len(totals), 2)]
        return sum(totals[0::2]) / sum(totals[1::2])

    def fields(self) -> dict:
        """The step record's ``val_loss_by_source`` when this step evaluated several sources (read
        once: the next step's record has none unless it evaluates again)."""
        fields = {"val_loss_by_source": self.by_source} if len(self.by_source) > 1 else {}
        self.by_source = []
        return fields
