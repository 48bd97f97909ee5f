"""ZeRO under expert parallelism, seen from outside as one ZeRO optimizer over the whole model.

Under expert parallelism a rank holds two partitions of optimizer state: its share of the dense
parameters' (the dense group, over the batch ranks) and its share of its own experts' (the expert
group, over the ranks holding the same experts). A checkpoint holds neither: it holds what a run
without expert parallelism on the same batch ranks holds, partition r of the whole model's flat
state (``canonical``: the FlatLayout of every parameter, every expert included, over the batch
ranks). So a checkpoint does not depend on ep: it resumes at any ep and any data-parallel degree,
and every tool that reads checkpoints (verify, reshard, consolidate, export) reads it unchanged.

``Plan`` lists the pieces: for each rank of the batch group, which ranges of its two partitions
fall in each canonical partition. Saving gathers them by one all-to-all over the batch ranks
(master, exp_avg and exp_avg_sq side by side, 12 bytes a parameter, each moved once); loading
sends them back by the inverse all-to-all. Copies only: the bytes are the optimizer's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlib.comm import collectives
from distlib.comm.group import Comm
from distlib.parallel.adamw import STATE_KEYS
from distlib.parallel.flat_layout import FlatLayout, ParamSlot
from distlib.parallel.zero.groups import GroupedOptimizer

DENSE, EXPERTS = "dense", "experts"  # the parameter groups' names


@dataclass(frozen=True)
class Piece:
    canon: int  # offset in the canonical flat vector
    numel: int
    group: str  # DENSE or EXPERTS: whose partition holds it on its rank
    local: int  # offset in that partition


def sub_layout(whole: FlatLayout, names: set[str], world_size: int) -> FlatLayout:
    """The parameters ``names`` of ``whole``, in its order, back to back (``FlatLayout.of`` of a
    module holding only them)."""
    slots, offset = [], 0
    for s in whole.slots:
        if s.name in names:
            slots.append(ParamSlot(s.name, s.shape, offset))
            offset += s.numel
    return FlatLayout(tuple(slots), world_size)


def _held(layout: FlatLayout, part: int, group: str, canon: dict[str, int]) -> list[Piece]:
    """The pieces of partition ``part`` of ``layout``, by canonical offset."""
    lo, hi = layout.shard_range(part)
    pieces = []
    for s in layout.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            pieces.append(Piece(canon[s.name] + a - s.offset, b - a, group, a - lo))
    return pieces


def _cut(pieces: list[Piece], lo: int, hi: int) -> list[Piece]:
    """The parts of ``pieces`` inside canonical [lo, hi)."""
    out = []
    for p in pieces:
        a, b = max(lo, p.canon), min(hi, p.canon + p.numel)
        if a < b:
            out.append(Piece(a, b - a, p.group, p.local + a - p.canon))
    return out


class Plan:
    """``sends[b][d]``: the pieces batch rank b holds of canonical partition d, in canonical order.

    ``canonical``: the whole model over the batch ranks; ``dense``: the dense group's layout;
    ``experts[j]``: the expert group's layout on ranks of expert-group rank j; ``places[b]``: batch
    rank b's (expert-group rank, expert-data-parallel rank)."""

    def __init__(
        self,
        canonical: FlatLayout,
        dense: FlatLayout,
        experts: list[FlatLayout],
        places: list[tuple[int, int]],
    ):
        self.canonical = canonical
        canon = {s.name: s.offset for s in canonical.slots}
        self.sends = []
        for b, (j, i) in enumerate(places):
            held = sorted(
                _held(dense, b, DENSE, canon) + _held(experts[j], i, EXPERTS, canon), key=lambda p: p.canon
            )
            self.sends.append([_cut(held, *canonical.shard_range(d)) for d in range(len(places))])

    def to_canonical(self, parts: dict[str, torch.Tensor], comm: Comm) -> torch.Tensor:
        """This rank's canonical partition, (shard_numel, k), from every rank's ``parts`` (group ->
        (its partition's numel, k)); collective over the batch ranks ``comm``."""
        me, n = comm.rank, comm.size
        width = next(iter(parts.values())).shape[1]
        mine = self.sends[me]
        send = torch.cat(
            [parts[p.group][p.local : p.local + p.numel] for d in range(n) for p in mine[d]]
            or [parts[DENSE][:0]]
        )
        got = collectives.all_to_all(
            send.contiguous(), comm, _sizes(mine), [_size(self.sends[b][me]) for b in range(n)]
        )
        lo = self.canonical.shard_range(me)[0]
        out = torch.zeros(self.canonical.shard_numel, width, dtype=send.dtype, device=send.device)
        at = 0
        for b in range(n):
            for p in self.sends[b][me]:
                out[p.canon - lo : p.canon - lo + p.numel] = got[at : at + p.numel]
                at += p.numel
        return out

    def from_canonical(
        self, shard: torch.Tensor, sizes: dict[str, int], comm: Comm
    ) -> dict[str, torch.Tensor]:
        """The inverse: this rank's partitions (group -> (``sizes[group]``, k)) from every rank's
        canonical ``shard``."""
        me, n = comm.rank, comm.size
        lo = self.canonical.shard_range(me)[0]
        wanted = [self.sends[b][me] for b in range(n)]  # what each rank holds of my partition
        send = torch.cat([shard[p.canon - lo : p.canon - lo + p.numel] for b in range(n) for p in wanted[b]])
        got = collectives.all_to_all(send.contiguous(), comm, _sizes(wanted), _sizes(self.sends[me]))
        parts = {g: shard.new_zeros(k, shard.shape[1]) for g, k in sizes.items()}
        at = 0
        for d in range(n):
            for p in self.sends[me][d]:
                parts[p.group][p.local : p.local + p.numel] = got[at : at + p.numel]
                at += p.numel
        return parts


def _size(pieces: list[Piece]) -> int:
    return sum(p.numel for p in pieces)


def _sizes(per_rank: list[list[Piece]]) -> list[int]:
    return [_size(pieces) for pieces in per_rank]


class ExpertParallelOptimizer:
    """A ``GroupedOptimizer`` of a dense and an expert group that saves and loads the canonical
    partition (``layout``, ``my_range``, ``state_views``, ``load_state_shard`` as ZeroOptimizer's);
    the step delegates to the groups."""

    def __init__(self, grouped: GroupedOptimizer, plan: Plan, batch: Comm):
        self.grouped, self.plan, self.batch = grouped, plan, batch
        self.layout = plan.canonical
        self.my_range = slice(*self.layout.shard_range(batch.rank))
        self.dense, self.experts = grouped.groups[DENSE], grouped.groups[EXPERTS]
        self.device = self.dense.device

    @property
    def step_count(self) -> int:
        return self.dense.step_count

    @property
    def grad_buffer(self) -> torch.Tensor:
        return self.dense.grad_buffer  # (fault injection writes into one gradient buffer)

    def param_parts(self) -> list[tuple[torch.Tensor, tuple, int]]:
        """Both groups' parameters, for the hooks that read or change them (fault injection)."""
        return self.dense.param_parts() + self.experts.param_parts()

    def sync_grads(self) -> float:
        return self.grouped.sync_grads()

    def apply_update(self, lr: float | None = None) -> None:
        self.grouped.apply_update(lr)

    def step(self, lr: float | None = None) -> float:
        return self.grouped.step(lr)

    def zero_grad(self) -> None:
        self.grouped.zero_grad()

    def param_norm(self) -> float:
        return self.grouped.param_norm()

    def memory_bytes(self) -> dict[str, int]:
        return self.grouped.memory_bytes()

    def memory_formula(self) -> dict[str, tuple[float, float, str]]:
        """Each category's formula: the dense group's plus the expert group's (each with its own P
        and N: the text says which is which)."""
        dense, experts = self.dense.memory_formula(), self.experts.memory_formula()
        return {
            k: (
                dense[k][0] + experts[k][0],
                dense[k][1] + experts[k][1],
                f"dense {dense[k][2]} + experts {experts[k][2]}",
            )
            for k in dense
        }

    def replica_parts(self) -> list[tuple[torch.Tensor, tuple, bool]]:
        """The dense group's parameters, then the experts' (held differently across the expert group)."""
        return [*self.dense.replica_parts(), (self.experts.full_params(), self.experts.layout.slots, True)]

    def params_snapshot(self) -> torch.Tensor:
        return torch.cat([self.dense.params_snapshot(), self.experts.params_snapshot()])

    def state_views(self) -> dict[str, torch.Tensor]:
        """This rank's canonical partition of (master, exp_avg, exp_avg_sq): new tensors, gathered
        from the ranks holding them (collective over the batch ranks)."""
        parts = {
            name: torch.stack([g.state_views()[k] for k in STATE_KEYS], dim=1)
            for name, g in self.grouped.groups.items()
        }
        shard = self.plan.to_canonical(parts, self.batch)
        return {k: shard[:, i].contiguous() for i, k in enumerate(STATE_KEYS)}

    def state_shard(self) -> dict[str, torch.Tensor]:
        return {k: v.to("cpu", copy=True) for k, v in self.state_views().items()}

    @torch.no_grad()
    def load_state_shard(self, shard: dict[str, torch.Tensor], step_count: int) -> None:
        """Load this rank's canonical partition (collective over the batch ranks)."""
        numel = self.layout.shard_numel
        for key in STATE_KEYS:
            if shard[key].shape != (numel,) or shard[key].dtype != torch.float32:
                raise ValueError(
                    f"checkpoint tensor {key!r} has shape {tuple(shard[key].shape)} "
                    f"{shard[key].dtype}; expected ({numel},) float32"
                )
        stacked = torch.stack([shard[k].to(self.device) for k in STATE_KEYS], dim=1)
        sizes = {name: g.layout.shard_numel for name, g in self.grouped.groups.items()}
        parts = self.plan.from_canonical(stacked, sizes, self.batch)
        for name, g in self.grouped.groups.items():
            mine = {k: parts[name][:, i].contiguous() for i, k in enumerate(STATE_KEYS)}
            g.load_state_shard(mine, step_count)
