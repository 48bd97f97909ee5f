"""How a model's layers reach what other ranks hold, chosen once, when the model is built.

A model is built for its layout: ``families.build(cfg, seed, strategies)`` hands each layer its
strategy object at construction, and the step path calls it without asking which one it got.

    context    how attention reaches the sequence's other tokens: ``attention.WHOLE`` (every rank
               holds whole sequences) or ``attention.ContextSplit`` over the context-parallel group
               (``dist.cp``; its ``impl``: all-to-all, DeepSpeed-Ulysses, or the ring)
    sequence   how the residual stream meets the tensor-parallel layers: ``REPLICATED`` (every
               tensor-parallel rank holds all of it) or ``SequenceSplit`` (``dist.sp``: each holds
               its share of the tokens between the regions); the model, its blocks and the
               column/row-parallel layers ``families.shard_model_`` makes follow it
    loads      how an MoE layer learns its experts' loads: read from the device (``READ``), or
               ``BALANCED`` in the planner's dry step, which has no values (``expert_loads``)

Where the experts run (``moe.ExpertsHere``, ``moe.ExpertsOverRanks``) is chosen when expert
parallelism drops the experts a rank does not hold (``families.hold_experts_``), the step at which
the parameters themselves change, as tensor parallelism's sharding is.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlib.app.model import expert_loads
from distlib.app.model.attention import WHOLE, Context, ContextSplit
from distlib.comm.mesh import Mesh
from distlib.parallel.sequence_parallel import SequenceSplit
from distlib.parallel.tensor_parallel import REPLICATED, Replicated


@dataclass(frozen=True)
class Strategies:
    context: Context = WHOLE
    sequence: Replicated | SequenceSplit = REPLICATED
    loads: expert_loads.Loads = expert_loads.READ


LOCAL = Strategies()  # one rank's model: whole sequences, the stream replicated


def for_layout(mesh: Mesh, cp_impl: str, sequence_parallel: bool) -> Strategies:
    """The strategies of this rank's model in ``mesh`` (``dist.cp_impl``, ``dist.sp``)."""
    context = WHOLE if mesh.cp is None else ContextSplit(mesh.cp, cp_impl)
    return Strategies(context, SequenceSplit(mesh.tp) if sequence_parallel else REPLICATED)
