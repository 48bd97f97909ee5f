"""The divergence guard and the replica check: decisions every rank takes identically.

``check_step`` runs after backward and before the update. Each rank contributes its
local loss and a non-finite flag to one all-reduce; the resulting global loss, the
grad norm (already identical on every rank: the optimizer all-gathers it) and the
accepted-loss history (built from earlier, identical verdicts) are the same bytes on
every rank, so every rank computes the same verdict without a second collective.

``check_replicas`` makes the "same parameter norm on every rank" invariant exact:
a sha256 per parameter of the bytes each rank will use for its next forward,
gathered and compared; a rank whose bytes differ is named with the parameter.
"""
from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass

import torch

from distlib import agree
from distlib.comm import Comm
from distlib.config import GuardConfig


class GuardError(RuntimeError):
    """The run diverged more often than guard.max_rollbacks allows (or could not roll back)."""


class DesyncError(RuntimeError):
    """Ranks hold different bytes for parameters that must be replicated."""


@dataclass(frozen=True)
class Verdict:
    loss: float              # the global mean loss (what the log shows)
    trip: str | None         # why this step must not be applied; None: apply it

    @property
    def ok(self) -> bool:
        return self.trip is None


def check_step(local_loss: float, grad_norm: float, history: list[float], cfg: GuardConfig,
               comm: Comm) -> Verdict:
    """The global loss and the verdict on it; ``history`` holds the accepted losses so far."""
    total, bad_ranks = agree.sum_all([local_loss, 0.0 if math.isfinite(local_loss) else 1.0], comm)
    loss = total / comm.size
    if not cfg.enabled:
        return Verdict(loss, None)
    if bad_ranks or not math.isfinite(loss):
        return Verdict(loss, f"non-finite loss {loss} (local loss non-finite on {int(bad_ranks)} rank(s))")
    if not math.isfinite(grad_norm):
        return Verdict(loss, f"non-finite gradient norm {grad_norm}")
    if history:
        recent = history[-cfg.spike_window:]
        reference = sum(recent) / len(recent)
        if loss > cfg.spike_factor * reference:
            what = "previous step's loss" if len(recent) == 1 else f"mean of the last {len(recent)} accepted losses"
            return Verdict(loss, f"loss spike: {loss:.6g} > {cfg.spike_factor:g} x {reference:.6g} ({what})")
    return Verdict(loss, None)


def parameter_digests(flat: torch.Tensor, slots) -> list[str]:
    """sha256 of each parameter's bytes in the flat buffer (slots: name, offset, numel)."""
    raw = flat.detach().contiguous().view(torch.uint8).numpy()
    size = flat.element_size()
    return [hashlib.sha256(raw[s.offset * size:(s.offset + s.numel) * size].tobytes()).hexdigest() for s in slots]


def check_replicas(flat: torch.Tensor, slots, step: int, comm: Comm) -> None:
    """Raise DesyncError on every rank if any parameter's bytes differ between ranks. Per
    parameter, the largest group of agreeing ranks (ties: the one with rank 0) is the
    reference and every other rank is reported as divergent."""
    mine = "\n".join(parameter_digests(flat, slots)).encode()
    every = [blob.decode().split("\n") for blob in agree.gather_bytes(mine, comm)]
    divergent: dict[int, list[str]] = {}
    for i, slot in enumerate(slots):
        digests = [rank_digests[i] for rank_digests in every]
        counts = Counter(digests)
        reference = max(counts, key=lambda d: (counts[d], d == digests[0]))
        for rank, d in enumerate(digests):
            if d != reference:
                divergent.setdefault(rank, []).append(slot.name)
    if divergent:
        parts = []
        for rank, names in sorted(divergent.items()):
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"rank {rank} differs in {len(names)} of {len(slots)} parameter(s): {shown}")
        raise DesyncError(f"desync at step {step}: replicated parameters are not byte-identical across "
                          f"{comm.size} ranks: " + "; ".join(parts))
