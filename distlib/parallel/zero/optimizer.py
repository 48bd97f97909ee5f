"""ZeRO over parameter groups, the one optimizer: each group of parameters averaged, and sharded,
over its own ranks (a dense model is one group over the data-parallel ranks, ``make_optimizer``).

One data-parallel group is not enough once parameters live on different sets of ranks: with
context parallelism every parameter is averaged over dp x cp; with experts, the dense parameters
over the batch group and an expert's over the ranks holding the same expert (its
expert-data-parallel group), while the ranks of the expert group hold other experts. A
``ParamGroup`` names its parameters, the ``Comm`` they are averaged and sharded over, and the
groups whose ranks hold different values of them; ``ZeroOptimizer`` runs one ZeRO stage
optimizer per group (``stages``; each with its own flat layout over its own ranks) and joins them
where they must agree: one global gradient norm over every group and kind (``norms``), so one clipping
coefficient, and one ``sync_grads``/``apply_update`` protocol, the base's.

It is what the trainer, the guard and a checkpoint talk to; a checkpoint holds what each rank
holds (``partitions``: every group's partition of its own flat layout, the first group's under the
plain state names, so a one-group checkpoint is the plain ZeRO one), and loading finds every
element by parameter name at any layout (``checkpoint.relayout``). With one group every answer is
that group's stage optimizer's, to the bit: the joined norm of one group is its own norm.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from distlib.comm.group import Comm
from distlib.parallel.adamw import STATE_KEYS, AdamWConfig
from distlib.parallel.flat_layout import Partition
from distlib.parallel.zero.base import StageOptimizer
from distlib.parallel.zero.stages import STAGES, check_stage


@dataclass(frozen=True)
class ParamGroup:
    name: str
    names: tuple[str, ...]  # its parameters (names in the module)
    comm: Comm  # their gradients are averaged, and their optimizer state sharded, over these ranks
    differs_over: tuple[Comm, ...] = ()  # groups whose ranks hold other values of them (experts: ep)
    # Each gradient times this as backward produces it, before the average over ``comm`` (experts
    # under expert parallelism: 1/ep, ``expert_parallel.expert_grad_scale``).
    grad_scale: float = 1.0


class ZeroOptimizer:
    """The ZeRO ``stage`` optimizer of every group of ``module``'s parameters (``groups`` partition
    them); ``tp``/``tp_split``/``pp`` and the other keywords as ``make_optimizer``'s."""

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroup],
        stage: int,
        cfg: AdamWConfig,
        grad_clip: float = 0.0,
        *,
        tp: Comm | None = None,
        tp_split: Collection[str] = (),
        tp_partial: Collection[str] = (),
        **options,
    ):
        _check_partition(module, groups)
        check_stage(stage)
        split, partial = set(tp_split), set(tp_partial)
        self.groups: dict[str, StageOptimizer] = {
            g.name: STAGES[stage](
                module,
                g.comm,
                cfg,
                grad_clip,
                names=g.names,
                tp=tp,
                tp_split=tuple(n for n in g.names if n in split),  # in module order
                tp_partial=tuple(n for n in g.names if n in partial),
                differs_over={name: g.differs_over for name in g.names} if g.differs_over else None,
                **options,
            )
            for g in groups
        }
        self._first = next(iter(self.groups.values()))
        self.device = self._first.device
        self.specs = {g.name: g for g in groups}
        self.prefixes = {g.name: "" if i == 0 else f"{g.name}." for i, g in enumerate(groups)}
        params = dict(module.named_parameters())
        for g in groups:
            if g.grad_scale != 1.0:
                for n in g.names:
                    params[n].register_hook(lambda grad, k=g.grad_scale: grad * k)

    def _joined(self, squares: list[torch.Tensor]) -> float:
        """The norm of several groups' sums of squares (added in group order, then the stages')."""
        total = squares[0]
        for more in squares[1:]:
            total = total + more
        return self._first.norms.finish(total)

    def sync_grads(self) -> float:
        """Average every group's gradients over its ranks; the global norm over all of them."""
        norm = self._joined([g.sync_squares() for g in self.groups.values()])
        for g in self.groups.values():
            g.use_norm(norm)
        return norm

    def apply_update(self, lr: float | None = None) -> None:
        for g in self.groups.values():
            g.apply_update(lr)

    def step(self, lr: float | None = None) -> float:
        grad_norm = self.sync_grads()
        self.apply_update(lr)
        return grad_norm

    def zero_grad(self) -> None:
        for g in self.groups.values():
            g.zero_grad()

    def param_norm(self) -> float:
        return self._joined([g.param_squares() for g in self.groups.values()])

    # -- what the trainer, the guard and the checkpoint ask of any optimizer -----------------
    @property
    def step_count(self) -> int:
        return self._first.step_count

    @property
    def grad_buffer(self) -> torch.Tensor:
        return self._first.grad_buffer  # (fault injection writes into one gradient buffer)

    def partitions(self) -> list[Partition]:
        """What this rank holds, group by group: the first group's state under the plain state
        names (one group saves what its stage optimizer saves), every other's under "<name>."."""
        return [Partition(self.prefixes[n], g.layout, g.comm.rank) for n, g in self.groups.items()]

    def state_views(self) -> dict[str, torch.Tensor]:
        """Every group's partition of (master, exp_avg, exp_avg_sq), live, under its prefix."""
        return {self.prefixes[n] + k: v for n, g in self.groups.items() for k, v in g.state_views().items()}

    def state_shard(self) -> dict[str, torch.Tensor]:
        return {k: v.to("cpu", copy=True) for k, v in self.state_views().items()}

    def load_state_shard(self, shard: dict[str, torch.Tensor], step_count: int) -> None:
        for n, g in self.groups.items():
            g.load_state_shard({k: shard[self.prefixes[n] + k] for k in STATE_KEYS}, step_count)

    def param_parts(self) -> list[tuple[torch.Tensor, tuple, int]]:
        """Every group's parameters, for the hooks that read or change them (fault injection)."""
        return [part for g in self.groups.values() for part in g.param_parts()]

    def replica_parts(self) -> list[tuple[torch.Tensor, tuple, bool]]:
        """What the replica check compares: a group held alike by its ranks as ZeRO's, one whose
        values differ over other ranks (experts) whole, marked so."""
        parts = []
        for n, g in self.groups.items():
            differs = bool(self.specs[n].differs_over)
            parts += [(g.full_params(), g.layout.slots, True)] if differs else g.replica_parts()
        return parts

    def params_snapshot(self) -> torch.Tensor:
        """A host copy of the parameter bytes this rank holds, group by group (restore checks)."""
        return torch.cat([g.params_snapshot() for g in self.groups.values()])

    def full_params(self) -> torch.Tensor:
        """Every parameter of this rank's model, flat, group by group in each one's layout order,
        without padding (at stage 3 a gathered copy: collective over each group's ranks)."""
        return torch.cat([g.full_params()[: g.layout.numel] for g in self.groups.values()])

    def memory_formula(self) -> dict[str, tuple[float, float, str]]:
        """Each category's formula: the groups' added (each with its own P and N, named)."""
        each = {n: g.memory_formula() for n, g in self.groups.items()}
        if len(each) == 1:
            return self._first.memory_formula()
        return {
            k: (
                sum(f[k][0] for f in each.values()),
                sum(f[k][1] for f in each.values()),
                " + ".join(f"{n} {f[k][2]}" for n, f in each.items()),
            )
            for k in each[next(iter(each))]
        }

    def memory_bytes(self) -> dict[str, int]:
        """Per category, the groups' peaks added (an upper bound of the joint peak)."""
        out: dict[str, int] = {}
        for g in self.groups.values():
            for category, peak in g.memory_bytes().items():
                out[category] = out.get(category, 0) + peak
        return out


def _check_partition(module: nn.Module, groups: Sequence[ParamGroup]) -> None:
    """Every parameter in exactly one group, every group named once and holding parameters."""
    names = [n for n, _ in module.named_parameters()]
    seen: dict[str, str] = {}
    for g in groups:
        if not g.names:
            raise ValueError(f"parameter group {g.name!r} holds no parameters")
        for n in g.names:
            if n in seen:
                raise ValueError(f"parameter {n!r} is in parameter groups {seen[n]!r} and {g.name!r}")
            seen[n] = g.name
    if len({g.name for g in groups}) != len(groups):
        raise ValueError(f"parameter group names repeat: {[g.name for g in groups]}")
    missing = [n for n in names if n not in seen]
    unknown = [n for n in seen if n not in names]
    if missing or unknown:
        raise ValueError(
            f"parameter groups must cover the model: missing {missing[:4]}, unknown {unknown[:4]}"
        )
