"""Expert parallelism: the experts of a layer split over the ranks of an expert group, tokens sent
to their experts' ranks and the outputs sent back, by the all-to-all with uneven splits.

An expert group of N ranks holds n_experts / N experts each, rank j the consecutive block
``held_experts(n_experts, N, j)``, so the rows a token rank dispatches, sorted by expert id, are
already cut by destination. One step of an MoE layer on every rank of the group:

    counts     each rank's rows per expert (n_experts integers), all-gathered over the group: every
               rank knows what every rank sends and receives (``Routing``; the one read of the
               device, the same one the one-rank layer takes for its own counts)
    dispatch   all-to-all of the rows, rank j's block to rank j; a rank receives, source by source,
               the rows for its experts, expert by expert
    experts    expert e runs once on its rows from every source, concatenated in source order: the
               rows one rank holding the whole batch would give it, in that order (the batch's
               samples are dealt to the ranks in rank order)
    return     the outputs cut back by source and all-to-all'd back, each rank receiving its own
               rows' outputs in the order it sent them; the combine (weights, sums) stays on the
               token's rank, in the one-rank order

Autograd: each all-to-all's backward is the all-to-all with the splits swapped. An expert's
gradient on its rank then sums the loss gradients of every rank of the expert group; averaging it
over its expert-data-parallel ranks (the ranks holding the same experts) therefore counts the
batch group's ranks N times too few in the divisor: ``EXPERT_GRAD_SCALE`` (1/N, exact for N a
power of two) is the factor ZeRO's parameter group applies first (``zero.ParamGroup``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from distlib.comm import collectives
from distlib.comm.group import Comm


def held_experts(n_experts: int, ranks: int, rank: int) -> range:
    """The experts rank ``rank`` of an expert group of ``ranks`` holds."""
    if n_experts % ranks:
        raise ValueError(f"{n_experts} experts do not split over {ranks} expert-parallel ranks")
    per = n_experts // ranks
    return range(rank * per, (rank + 1) * per)


def expert_grad_scale(ep: Comm) -> float:
    """What an expert's summed gradient is multiplied by before its average over the ranks holding
    it (module docstring): 1 / the expert group's size."""
    return 1.0 / ep.size


class _Exchange(torch.autograd.Function):
    """all_to_all(x, send, recv) forward; all_to_all(grad, recv, send) backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.comm, ctx.send, ctx.recv = comm, send, recv
        return collectives.all_to_all(x.contiguous(), comm, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return collectives.all_to_all(grad.contiguous(), ctx.comm, ctx.recv, ctx.send), None, None, None


def exchange(rows: torch.Tensor, comm: Comm, send: list[int], recv: list[int]) -> torch.Tensor:
    """The all-to-all of ``rows`` (``send[j]`` of them to rank j, ``recv[i]`` from rank i) with its
    autograd: the gradient goes back by the all-to-all with the splits swapped. Any split may be
    zero, and so may all of them."""
    return _Exchange.apply(rows, comm, send, recv)


@dataclass(frozen=True)
class Routing:
    """``counts[s][e]``: the rows rank s of the expert group sends expert e."""

    counts: list[list[int]]
    rank: int

    @classmethod
    def gather(cls, counts: torch.Tensor, ep: Comm) -> Routing:
        """Every rank's counts from this rank's (n_experts,) integer tensor (collective over ``ep``)."""
        n = counts.numel()
        table = counts.new_zeros(ep.size * n)
        collectives.all_gather(table, counts.reshape(-1), ep)
        return cls(table.view(ep.size, n).tolist(), ep.rank)

    def held(self, rank: int) -> range:
        return held_experts(len(self.counts[0]), len(self.counts), rank)

    def send(self) -> list[int]:
        mine = self.counts[self.rank]
        return [sum(mine[e] for e in self.held(j)) for j in range(len(self.counts))]

    def recv(self) -> list[int]:
        return [sum(row[e] for e in self.held(self.rank)) for row in self.counts]


def run_experts(
    rows: torch.Tensor, routing: Routing, experts: Mapping[int, nn.Module], ep: Comm
) -> torch.Tensor:
    """The outputs of this rank's dispatched ``rows`` (every expert's, in expert order, as counted
    in ``routing.counts[ep.rank]``), in the same order; ``experts``: the ones this rank holds."""
    send, recv = routing.send(), routing.recv()
    got = exchange(rows, ep, send, recv)
    held = routing.held(ep.rank)
    sources = range(ep.size)
    pieces = got.split([routing.counts[s][e] for s in sources for e in held])
    at = {(s, e): pieces[i] for i, (s, e) in enumerate((s, e) for s in sources for e in held)}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    for e in held:
        # One call per expert on every source's rows (on zero rows when none came: its weights get
        # a zero gradient all the same, as ZeRO's gradient buckets wait for every parameter).
        y = experts[e](torch.cat([at[s, e] for s in sources]))
        outputs.update(zip(((s, e) for s in sources), y.split([routing.counts[s][e] for s in sources])))
    back = torch.cat([outputs[s, e] for s in sources for e in held])
    return exchange(back, ep, recv, send)


def keep_held_experts_(experts: nn.ModuleList, ep: Comm) -> nn.ModuleDict:
    """This rank's experts of a full list, keyed by their ids (so their parameters keep the names
    ``<e>.w1.weight`` ... that the whole model gives them); the others are dropped."""
    return nn.ModuleDict({str(e): experts[e] for e in held_experts(len(experts), ep.size, ep.rank)})
