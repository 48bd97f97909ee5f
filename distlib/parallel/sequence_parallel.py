"""Megatron's sequence parallelism inside tensor parallelism (``dist.sp``).

Between the tensor-parallel regions (the norms, the residual adds, the residual dropout) every
tensor-parallel rank holds the same activations: tensor parallelism alone keeps T copies of them.
With sequence parallelism rank t holds only tokens [t*S/T, (t+1)*S/T) of the residual stream there,
and the communication at the regions' edges changes shape, not volume (an all-reduce is a
reduce-scatter plus an all-gather):

  ``scatter``  after the embedding    forward: keep this rank's tokens;  backward: all-gather
  ``enter``    before column layers   forward: all-gather the tokens;    backward: reduce-scatter
  ``leave``    after a row layer      forward: reduce-scatter the sum;   backward: all-gather
  ``gather``   before the head        forward: all-gather the tokens;    backward: keep this rank's

``enter`` replaces the column-parallel layers' ``copy_to_tp`` (its backward reduce-scatter sums the
input gradient the all-reduce summed) and runs once per region, so q, k and v share one gathered
input; ``leave`` replaces the row-parallel layer's all-reduce. The head and loss run on the whole
sequence, replicated as with tensor parallelism alone, so the loss is the same number.

A replicated parameter used on the shards (a norm's weight, a row-parallel bias added after the
reduce-scatter) gets from each rank the gradient of that rank's tokens only; a module names them
(``sequence_sharded_parameters``) and the optimizer sums their gradients over the group once per
step (``parallel.zero.partial_sums``), so the replicas stay bitwise equal. Residual dropout keeps
the whole sequence's mask at the positions this rank holds (``SequenceSplit.held``;
``distlib.parallel.dropout``): the masks of tensor parallelism alone, and of one rank.

The collectives are ours, on flat contiguous tensors: (batch, seq, dim) activations are made
sequence-major, (seq, batch, dim), so that each rank's tokens are one contiguous piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlib.comm import collectives
from distlib.comm.group import Comm
from distlib.parallel.collective_op import collective_function


def _own(full: torch.Tensor, tp: Comm) -> torch.Tensor:
    """This rank's tokens of a (batch, seq, ...) tensor."""
    n = full.shape[1] // tp.size
    return full[:, tp.rank * n : (tp.rank + 1) * n].contiguous()


def _all_gather(shard: torch.Tensor, tp: Comm) -> torch.Tensor:
    """(batch, seq/T, ...) on every rank -> (batch, seq, ...), the ranks' tokens in rank order."""
    major = shard.transpose(0, 1).contiguous()
    out = torch.empty((major.shape[0] * tp.size, *major.shape[1:]), dtype=shard.dtype, device=shard.device)
    collectives.all_gather(out, major, tp)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter(full: torch.Tensor, tp: Comm) -> torch.Tensor:
    """(batch, seq, ...) partial sums on every rank -> this rank's tokens of their sum."""
    major = full.transpose(0, 1).contiguous()
    mine = collectives.reduce_scatter(major, tp, op="sum")
    return mine.view(major.shape[0] // tp.size, *major.shape[1:]).transpose(0, 1).contiguous()


_Scatter = collective_function("_Scatter", _own, _all_gather)
# What follows a gather runs replicated, so every rank holds the same gradient: no sum to take.
_Gather = collective_function("_Gather", _all_gather, _own)
# Every rank's tokens to every rank, each rank's gradient summed back to the tokens' owner: into a
# tensor-parallel region here; context parallelism gathers DeepSeek-V3's latent with it too.
GatherTokens = collective_function("GatherTokens", _all_gather, _reduce_scatter)
_Leave = collective_function("_Leave", _reduce_scatter, _all_gather)  # out of one
# A computation every rank runs whole inside a region gives every rank the whole input gradient,
# which the region's entry (its backward reduce-scatter) sums over the ranks: each brings 1/tp.
_Share = collective_function("_Share", lambda x, tp: x, lambda grad, tp: grad / tp.size)


@dataclass(frozen=True)
class SequenceSplit:
    """The residual stream split along the sequence over the tensor-parallel group ``tp``: the
    strategy a model built with ``dist.sp`` gives its blocks and tensor-parallel layers."""

    tp: Comm

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % self.tp.size:
            raise ValueError(
                f"sequence parallelism: {x.shape[1]} tokens do not split over {self.tp.size} "
                f"tensor-parallel ranks"
            )
        return _Scatter.apply(x, self.tp)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(x, self.tp)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return GatherTokens.apply(x, self.tp)

    def replicated_in(self, x: torch.Tensor) -> torch.Tensor:
        """The input of a computation every rank runs whole inside a region (an MoE router on the
        gathered tokens): its gradient, the same on every rank, enters the region's sum as 1/tp."""
        return _Share.apply(x, self.tp)

    def replicated_out(self, x: torch.Tensor) -> torch.Tensor:
        """A region's (batch, seq, dim) output every rank holds whole and complete (an MoE layer's
        combined experts, whose rows were all-reduced): this rank's tokens (backward: all-gather)."""
        return self.scatter(x)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:  # e.g. an expert's rows of routed tokens: no sequence to split
            raise ValueError(f"sequence parallelism: a {tuple(x.shape)} output is not (batch, seq, dim)")
        return _Leave.apply(x, self.tp)

    def into_column(self, x: torch.Tensor, tp: Comm) -> torch.Tensor:
        """A column layer's input: the block gathered it already (``enter``)."""
        return x

    def out_of_row(self, partial: torch.Tensor, tp: Comm) -> torch.Tensor:
        """A row layer's partial sums: reduce-scattered to this rank's tokens (``leave``)."""
        return self.leave(partial)

    @property
    def parts(self) -> int:
        return self.tp.size

    def held(self, positions: torch.Tensor) -> torch.Tensor:
        """The positions of the tokens this rank holds in the stream (its share of ``positions``)."""
        n = positions.shape[0] // self.tp.size
        return positions[self.tp.rank * n : (self.tp.rank + 1) * n]
