"""How an MoE layer learns its experts' loads -- the rows each expert receives -- which cut its
dispatched rows (and, with expert parallelism, the all-to-all's splits) into Python integers.

    READ       the run's: the counts its router produced, read from the device once per layer
               (``Tensor.tolist``; with expert parallelism every rank's, all-gathered first), and
               the load-balancing loss's value when the step's routing is counted first
               (``routing_count``)
    BALANCED   the planner's dry step on the meta device, which has shapes and no values: every
               expert the same share of the layer's assignments (the first ones one more where they
               do not divide), on every rank of the expert group; the loss's value 0

Chosen when the model is built (``strategies.Strategies.loads``): ``placement.shape_model``, the
planner's builder, takes ``BALANCED``. What a rank keeps and computes with every expert on it is
the same for any loads of the same total (each expert's rows are its own; they add up to the
assignments), so there the dry step is the run's to the byte; over expert-parallel ranks a rank
receives what the router sends its experts, and balanced loads are an estimate
(docs/parallelism.md, "Activations").
"""

from __future__ import annotations

import torch

from distlib.comm.group import Comm
from distlib.parallel import expert_parallel


def balanced(assignments: int, experts: int) -> list[int]:
    """``assignments`` dealt over ``experts`` as evenly as they go, the first ones one more."""
    share, more = divmod(assignments, experts)
    return [share + (e < more) for e in range(experts)]


class Read:
    def value(self, value: torch.Tensor) -> float:
        """A value the step reads back (the load-balancing loss's, counted before the step)."""
        return float(value)

    def here(self, counts: torch.Tensor, assignments: int) -> list[int]:
        """Rows per expert of this rank's ``counts`` ((n_experts,) on the device)."""
        return counts.tolist()

    def over(self, counts: torch.Tensor, assignments: int, ep: Comm) -> expert_parallel.Routing:
        """Every rank of the expert group ``ep``'s rows per expert (collective over ``ep``)."""
        return expert_parallel.Routing.gather(counts, ep)


class Balanced:
    def value(self, value: torch.Tensor) -> float:
        return 0.0  # (the dry step's values are never read: only shapes count there)

    def here(self, counts: torch.Tensor, assignments: int) -> list[int]:
        return balanced(assignments, counts.numel())

    def over(self, counts: torch.Tensor, assignments: int, ep: Comm) -> expert_parallel.Routing:
        # (every rank of the group routes as many tokens: the batch is dealt evenly)
        return expert_parallel.Routing([balanced(assignments, counts.numel())] * ep.size, ep.rank)


READ = Read()
BALANCED = Balanced()
