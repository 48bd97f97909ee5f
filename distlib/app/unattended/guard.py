"""The divergence guard and the replica check: decisions every rank takes identically.

``check_step`` runs after backward and before the update. Each rank contributes its
local loss and its grad norm to one all-gather; from those rows (the same bytes on
every rank) and the accepted-loss history (built from earlier, identical verdicts)
every rank computes the same verdict without a second collective. The loss is the
mean over ``loss_ranks`` (one data-parallel group: tensor-parallel ranks share a loss),
summed in rank order like ``agree.mean``; a non-finite loss or norm on any rank trips.

``check_replicas`` makes the "same parameter norm on every rank" invariant exact:
a sha256 per parameter of the bytes each rank will use for its next forward,
gathered and compared among the ranks that must hold the same bytes (with tensor
parallelism: a split parameter within its data-parallel group, a replicated one
across all ranks); a rank whose bytes differ is named with the parameter.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass

import torch

from distlib.app.config.operation import GuardConfig
from distlib.comm import agree
from distlib.comm.group import Comm
from distlib.comm.layout import Layout
from distlib.parallel.flat_layout import ParamSlot


class GuardError(RuntimeError):
    """The run diverged more often than guard.max_rollbacks allows (or could not roll back)."""


class DesyncError(RuntimeError):
    """Ranks hold different bytes for parameters that must be replicated."""


@dataclass(frozen=True)
class Verdict:
    loss: float  # the global mean loss (what the log shows)
    trip: str | None  # why this step must not be applied; None: apply it

    @property
    def ok(self) -> bool:
        return self.trip is None


def check_step(
    local_loss: float,
    grad_norm: float,
    history: list[float],
    cfg: GuardConfig,
    comm: Comm,
    loss_ranks: tuple[int, ...] | None = None,
) -> Verdict:
    """The global loss and the verdict on it; ``history`` holds the accepted losses so far.
    ``loss_ranks``: the global ranks whose mean is the loss (default: all of ``comm``)."""
    rows = agree.gather([local_loss, grad_norm], comm)
    members = [comm.ranks.index(r) for r in loss_ranks] if loss_ranks is not None else range(comm.size)
    total = 0.0
    for i in members:  # in rank order, one add at a time: agree.mean's bits
        total += rows[i][0]
    loss = total / len(members)
    if not cfg.enabled:
        return Verdict(loss, None)
    bad_ranks = sum(not math.isfinite(row[0]) for row in rows)
    if bad_ranks or not math.isfinite(loss):
        return Verdict(loss, f"non-finite loss {loss} (local loss non-finite on {bad_ranks} rank(s))")
    bad_norms = [row[1] for row in rows if not math.isfinite(row[1])]
    if bad_norms:
        return Verdict(loss, f"non-finite gradient norm {bad_norms[0]}")
    if history:
        recent = history[-cfg.spike_window :]
        reference = sum(recent) / len(recent)
        if loss > cfg.spike_factor * reference:
            what = (
                "previous step's loss"
                if len(recent) == 1
                else f"mean of the last {len(recent)} accepted losses"
            )
            return Verdict(loss, f"loss spike: {loss:.6g} > {cfg.spike_factor:g} x {reference:.6g} ({what})")
    return Verdict(loss, None)


def parameter_digests(flat: torch.Tensor, slots) -> list[str]:
    """sha256 of each parameter's bytes in the flat buffer (slots: name, offset, numel)."""
    raw = flat.detach().contiguous().view(torch.uint8).cpu().numpy()
    size = flat.element_size()
    return [
        hashlib.sha256(raw[s.offset * size : (s.offset + s.numel) * size].tobytes()).hexdigest()
        for s in slots
    ]


def replica_groups(stage: Layout, is_split: bool, expert: bool = False) -> list[tuple[int, ...]]:
    """The groups of ranks (group ranks of one pipeline stage, laid out as ``stage``) that must hold
    identical bytes of a parameter: a tensor-parallel split one within each group of the batch
    dimensions (same tensor rank), a replicated one across every rank; an expert's (``expert``,
    under ``ep``) only among the ranks holding the same experts (the expert-data-parallel group)."""
    batch = ("edp",) if expert else ("dp", "cp")
    return stage.groups(batch if is_split else (*batch, "tp"))


def check_replicas(
    parts,
    step: int,
    comm: Comm,
    stage: Layout,
    split: set[str] | frozenset = frozenset(),
) -> None:
    """Raise DesyncError on every rank if any parameter's bytes differ between ranks that must
    agree on them (``replica_groups`` of ``stage``, the layout of ``comm``'s ranks; ``parts``:
    (flat buffer, slots, experts) per parameter group, ``experts`` true for the experts under
    ``ep``, which the ranks of an expert group hold different ones of; ``split``: the names of
    tensor-parallel split parameters). Per parameter and group, the largest set of agreeing ranks
    (ties: the one with the group's first rank) is the reference and every other rank is reported
    as divergent."""
    # each line says what groups it is compared in: every rank reads every rank's the same way
    mine = [
        f"{int(experts)} {int(s.name in split)} {s.name} {d}"
        for flat, slots, experts in parts
        for s, d in zip(slots, parameter_digests(flat, slots))
    ]
    blobs = agree.gather_bytes("\n".join(mine).encode(), comm)
    every = [blob.decode().split("\n") if blob else [] for blob in blobs]
    groups = {
        (is_split, expert): {r: g for g in replica_groups(stage, is_split, expert) for r in g}
        for is_split in (False, True)
        for expert in (False, True)
    }
    divergent: dict[int, list[str]] = {}
    for rank, lines in enumerate(every):
        for i, line in enumerate(lines):
            expert, is_split, name, _ = line.split(" ")
            group = groups[is_split == "1", expert == "1"][rank]
            # a rank's i-th line against the same line of its group (the same name, the same bytes)
            held = [every[r][i] if i < len(every[r]) else None for r in group]
            counts = Counter(held)
            if line != max(counts, key=lambda d: (counts[d], d == held[0])):
                divergent.setdefault(rank, []).append(name)
    if divergent:
        said = []
        for rank, names in sorted(divergent.items()):
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            said.append(f"rank {rank} differs in {len(names)} of {len(every[rank])} parameter(s): {shown}")
        raise DesyncError(
            f"desync at step {step}: replicated parameters are not byte-identical across "
            f"{comm.size} ranks: " + "; ".join(said)
        )


def buffer_parts(buffers: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, tuple[ParamSlot], int]]:
    """State buffers a run changes (name -> tensor), each as a part of its own the way
    ``param_parts`` gives parameters: (a flat view of the buffer, its one slot, flat start 0)."""
    return [(t.view(-1), (ParamSlot(name, tuple(t.shape), 0),), 0) for name, t in buffers.items()]


class ReplicaCheck:
    """Every ``guard.check_sync_every`` steps, ``check_replicas`` on what must be identical: every
    parameter within its data-parallel group (ranks with the same tensor-parallel shard) and the
    non-split ones across all ranks; under dist.ep an expert's among the ranks holding it; and the
    state buffers a run changes (``buffers``: model.balance=bias's expert biases, which every rank
    of a stage moves alike) across all ranks. At ZeRO stage 3 the parameters are gathered first
    (collective over each group's ranks); with dist.tp=1 there no parameter is held by two ranks,
    so only the buffers are compared, and without buffers there is nothing to compare."""

    def __init__(
        self, every: int, zero_stage: int, mesh, tp_splits: dict, optimizer, buffers: dict | None = None
    ):
        self.every, self.mesh, self.optimizer = every, mesh, optimizer
        self.split = frozenset(tp_splits)
        # views of the buffers, which are only ever changed in place: made once
        self.buffer_parts = [(flat, slots, False) for flat, slots, _ in buffer_parts(buffers or {})]
        self.params_held_twice = zero_stage != 3 or mesh.tp.size > 1
        self.possible = self.params_held_twice or bool(self.buffer_parts)
        self.why_not = (
            "at ZeRO stage 3 with dist.tp=1 no parameter is held by two ranks, so the replica "
            "check has nothing to compare"
        )

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and self.possible

    def check(self, step: int, log) -> None:
        """Raise DesyncError (on every rank alike) naming the ranks and parameters that differ,
        once ``log`` (the metrics) has a "desync" event saying so."""
        parts = self.optimizer.replica_parts() if self.params_held_twice else []
        parts += self.buffer_parts
        try:
            check_replicas(parts, step, self.mesh.stage, self.mesh.layout.stage(), self.split)
        except DesyncError as exc:
            log.event("desync", step, say=str(exc), message=str(exc))
            raise
