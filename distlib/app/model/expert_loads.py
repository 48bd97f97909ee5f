"""How an MoE layer learns its experts' loads -- the rows each expert receives -- which cut its
dispatched rows (and, with expert parallelism, the all-to-all's splits) into Python integers.

    READ       the run's: the counts its router produced, read from the device once per layer
               (``Tensor.tolist``; with expert parallelism every rank's, all-gathered first), and
               the load-balancing loss's value when the step's routing is counted first
               (``routing_count``)
    BALANCED   the planner's dry step on the meta device, which has shapes and no values: every
               expert the same share of the layer's assignments (the first ones one more where they
               do not divide), on every rank of the expert group; the loss's value 0
    HOTTEST    the planner's bound on memory: the most rows the router could send this rank's
               experts, the first of them the fullest (``hottest``); the loss's value 0

Chosen when the model is built (``strategies.Strategies.loads``): ``placement.shape_model``, the
planner's builder, takes ``BALANCED`` for a step's time and ``HOTTEST`` for its bytes where the
router decides them. What a rank keeps with every expert on it is the same for any loads of the
same total (each expert's rows are its own; they add up to the assignments), so there the kept
bytes are the run's to the byte with either; over expert-parallel ranks a rank receives what the
router sends its experts, and a step's peak can hold one expert's rows at once: there balanced
loads are what a balanced router gives, the hottest the most any router can (docs/parallelism.md,
"Activations").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlib.comm.group import Comm
from distlib.parallel import expert_parallel


@dataclass(frozen=True)
class Routed:
    """What one rank's router chose from: its ``tokens``, each to ``top_k`` distinct experts, and
    ``most``, the most assignments one expert can keep (the tokens, or less under a capacity)."""

    tokens: int
    top_k: int
    most: int

    @property
    def assignments(self) -> int:
        return self.tokens * self.top_k


def balanced(assignments: int, experts: int) -> list[int]:
    """``assignments`` dealt over ``experts`` as evenly as they go, the first ones one more."""
    share, more = divmod(assignments, experts)
    return [share + (e < more) for e in range(experts)]


def hottest(routed: Routed, experts: int, held: range) -> list[int]:
    """Rows per expert of one rank's tokens where its router sends the experts ``held`` (those
    of one expert-parallel rank; every one with none) the most it can: no token reaches an expert
    twice, nor ``held`` more than ``top_k`` times, nor an expert more than ``routed.most``; the
    held ones filled first, in order, then the others, until every assignment is placed or no
    expert takes more. No routing gives ``held`` more rows, nor one expert, nor the rank in all."""
    counts = [0] * experts
    first = list(held) or list(range(experts))
    to_held = routed.tokens * min(routed.top_k, len(first))
    placed = _fill(counts, first, to_held, routed.most)
    _fill(counts, [e for e in range(experts) if e not in first], routed.assignments - placed, routed.most)
    return counts


def _fill(counts: list[int], experts: list[int], rows: int, most: int) -> int:
    """Up to ``rows`` rows into ``experts`` in order, at most ``most`` each; how many went."""
    placed = 0
    for e in experts:
        counts[e] = min(most, rows - placed)
        placed += counts[e]
    return placed


class Read:
    def value(self, value: torch.Tensor) -> float:
        """A value the step reads back (the load-balancing loss's, counted before the step)."""
        return float(value)

    def here(self, counts: torch.Tensor, routed: Routed) -> list[int]:
        """Rows per expert of this rank's ``counts`` ((n_experts,) on the device)."""
        return counts.tolist()

    def over(self, counts: torch.Tensor, routed: Routed, ep: Comm) -> expert_parallel.Routing:
        """Every rank of the expert group ``ep``'s rows per expert (collective over ``ep``)."""
        return expert_parallel.Routing.gather(counts, ep)


class Balanced:
    def value(self, value: torch.Tensor) -> float:
        return 0.0  # (the dry step's values are never read: only shapes count there)

    def here(self, counts: torch.Tensor, routed: Routed) -> list[int]:
        return balanced(routed.assignments, counts.numel())

    def over(self, counts: torch.Tensor, routed: Routed, ep: Comm) -> expert_parallel.Routing:
        # (every rank of the group routes as many tokens: the batch is dealt evenly)
        return expert_parallel.Routing([balanced(routed.assignments, counts.numel())] * ep.size, ep.rank)


class Hottest:
    def value(self, value: torch.Tensor) -> float:
        return 0.0  # (as ``Balanced``'s: never read)

    def here(self, counts: torch.Tensor, routed: Routed) -> list[int]:
        return hottest(routed, counts.numel(), range(0))

    def over(self, counts: torch.Tensor, routed: Routed, ep: Comm) -> expert_parallel.Routing:
        # Every rank of the group sends this one's experts the most it can (each routes as many
        # tokens), so this rank receives, keeps and computes the most any routing gives it.
        n = counts.numel()
        row = hottest(routed, n, expert_parallel.held_experts(n, ep.size, ep.rank))
        return expert_parallel.Routing([row] * ep.size, ep.rank)


READ = Read()
BALANCED = Balanced()
HOTTEST = Hottest()
Loads = Read | Balanced | Hottest  # (the strategies' type)
