"""ZeRO over parameter groups: each group of parameters averaged, and sharded, over its own ranks.

One data-parallel group is not enough once parameters live on different sets of ranks: with
context parallelism every parameter is averaged over dp x cp; with experts, the dense parameters
over the batch group and an expert's over the ranks holding the same expert (its
expert-data-parallel group), while the ranks of the expert group hold other experts. A
``ParamGroup`` names its parameters, the ``Comm`` they are averaged and sharded over, and the
groups whose ranks hold different values of them; ``GroupedOptimizer`` runs one ZeRO stage
optimizer per group (each with its own flat layout over its own ranks) and joins them where they
must agree: one global gradient norm over every group and kind (``norms``), so one clipping
coefficient, and one ``sync_grads``/``apply_update`` protocol, the base's.

With one group over the data-parallel ranks it is the plain ``ZeroOptimizer`` (``make_optimizer``),
which is what a run uses until a dimension needs more.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from distlib.comm.group import Comm
from distlib.parallel.adamw import AdamWConfig
from distlib.parallel.zero import STAGES
from distlib.parallel.zero.base import ZeroOptimizer


@dataclass(frozen=True)
class ParamGroup:
    name: str
    names: tuple[str, ...]  # its parameters (names in the module)
    comm: Comm  # their gradients are averaged, and their optimizer state sharded, over these ranks
    differs_over: tuple[Comm, ...] = ()  # groups whose ranks hold other values of them (experts: ep)
    # Each gradient times this as backward produces it, before the average over ``comm`` (experts
    # under expert parallelism: 1/ep, ``expert_parallel.expert_grad_scale``).
    grad_scale: float = 1.0


class GroupedOptimizer:
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
        **options,
    ):
        _check_partition(module, groups)
        split = set(tp_split)
        self.groups: dict[str, ZeroOptimizer] = {
            g.name: STAGES[stage](
                module,
                g.comm,
                cfg,
                grad_clip,
                names=g.names,
                tp=tp,
                tp_split=split & set(g.names),
                differs_over={name: g.differs_over for name in g.names} if g.differs_over else None,
                **options,
            )
            for g in groups
        }
        self._first = next(iter(self.groups.values()))
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

    def state_shards(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per group, this rank's partition of (master, exp_avg, exp_avg_sq), as fp32 host copies."""
        return {name: g.state_shard() for name, g in self.groups.items()}

    def load_state_shards(self, shards: dict[str, dict[str, torch.Tensor]], step_count: int) -> None:
        for name, g in self.groups.items():
            g.load_state_shard(shards[name], step_count)

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
