"""Every rank's model-state bytes for a configuration, predicted without starting a process.

For each rank the planner builds what ``rank_build.build`` builds there -- the layout's model, cut to
the rank's pipeline chunks and tensor-parallel shards (``placement``), its experts dropped to the
rank's own (``optimizer.param_groups_``) -- on the meta device, from a mesh that only names ranks
(``comm.mesh.shape_mesh``), and asks ZeRO what each parameter group's stage will peak at
(``parallel.zero.predict``): the figures the end-of-run memory table measures, to the byte (with
``zero.overlap``: the most they can be). Ranks that differ only in their tensor-parallel, data or
expert coordinate hold the same shapes; one build per pipeline stage serves them (cached per
layout, so a search over stages, dtypes and micro-batches builds each stage once).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass

import torch.nn as nn

from distlib.app.config.groups import ZeroConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.operation import DistConfig
from distlib.app.config.run import DTYPES, RunConfig
from distlib.app.model.placement import chunk_segments, place_model_, shape_model
from distlib.app.optimizer import param_groups_
from distlib.comm.layout import Layout
from distlib.comm.mesh import shape_mesh
from distlib.parallel.flat_layout import FlatLayout
from distlib.parallel.pipeline.schedule import stage_block_ids
from distlib.parallel.zero.predict import peak_bytes


@dataclass(frozen=True)
class RankStates:
    rank: int
    params: int  # bytes, each category's peak over the run (as the memory table measures)
    grads: int
    optimizer: int
    exact: bool  # False: an upper bound (zero.overlap's communication thread decides the rest)

    def as_dict(self) -> dict[str, int]:
        return {"rank": self.rank, "params": self.params, "grads": self.grads, "optimizer": self.optimizer}


def model_states(cfg: RunConfig) -> list[RankStates]:
    """Per rank of ``cfg``'s layout, in rank order, its predicted model-state peak bytes."""
    layout = cfg.layout
    dist = group_shape(cfg.dist)
    stages = [_stage_states(cfg.model, dist, cfg.zero, cfg.train.dtype, s) for s in range(layout.pp)]
    return [
        dataclasses.replace(stages[layout.coords(rank)["pp"]], rank=rank) for rank in range(layout.world_size)
    ]


@functools.lru_cache(maxsize=1024)
def group_shape(dist: DistConfig) -> DistConfig:
    """``dist`` with what does not change a rank's parameter groups at its default -- the
    pipeline's schedule (of its chunks per rank), sequence parallelism -- so the layouts a search
    varies in those share one build."""
    schedule = "interleaved" if dist.pp_virtual > 1 else DistConfig.pp_schedule
    return dataclasses.replace(dist, pp_schedule=schedule, sp=False)


@functools.lru_cache(maxsize=4096)
def _stage_states(
    model: ModelConfig, dist: DistConfig, zero: ZeroConfig, dtype: str, stage: int
) -> RankStates:
    """What each rank of pipeline stage ``stage`` holds (rank: the stage's first)."""
    param_dtype = DTYPES[dtype]
    peaks = [
        peak_bytes(zero.stage, module, flat, param_dtype, zero.bucket_numel, zero.overlap, segments)
        for module, flat, segments in stage_groups(model, dist, stage)
    ]
    return RankStates(
        rank=0,
        params=sum(p.params for p in peaks),
        grads=sum(p.grads for p in peaks),
        optimizer=sum(p.optimizer for p in peaks),
        exact=all(p.exact for p in peaks),
    )


@functools.lru_cache(maxsize=256)
def stage_groups(model: ModelConfig, dist: DistConfig, stage: int) -> list[tuple]:
    """The module, flat layout and chunks' names (``chunk_segments``) of each parameter group the
    first rank of pipeline stage ``stage`` holds (the stage's other ranks hold the same shapes)."""
    module, segments = _placed(model, dist.tp, dist.pp, dist.pp_virtual, stage)
    if dist.ep > 1:
        module = copy.deepcopy(module)  # (its experts are dropped to the rank's own, in place)
    layout = RunConfig(model=model, dist=dist).layout
    groups = param_groups_(module, shape_mesh(layout, layout.rank(pp=stage)))
    return [(module, FlatLayout.of(module, g.comm.size, g.names), segments) for g in groups]


@functools.lru_cache(maxsize=256)
def _placed(model: ModelConfig, tp: int, pp: int, virtual: int, stage: int) -> tuple[nn.Module, tuple]:
    """The model cut to pipeline stage ``stage`` and tensor-parallel rank 0's shards, and its
    chunks' names: ``place_model_`` on a copy of the whole model, in a world of just tp x pp."""
    schedule = "interleaved" if virtual > 1 else DistConfig.pp_schedule
    dist = DistConfig(world_size=tp * pp, tp=tp, pp=pp, pp_virtual=virtual, pp_schedule=schedule)
    cfg = RunConfig(model=model, dist=dist)
    mesh = shape_mesh(cfg.layout, cfg.layout.rank(pp=stage))
    module = _copied_for(_whole(model), pp, virtual, stage)
    chunks, _ = place_model_(module, cfg, mesh)
    return module, chunk_segments(module, chunks)


def _copied_for(whole: nn.Module, pp: int, virtual: int, stage: int) -> nn.Module:
    """A deep copy of ``whole`` for pipeline stage ``stage``, sharing with it the parts the stage
    drops (``keep_stage_``, which only lets go of them): the 16-rank search's copies of a whole
    16-block model were a quarter of its time."""
    if pp == 1:
        return copy.deepcopy(whole)
    kept = {i for chunk in stage_block_ids(len(whole.blocks), pp, virtual, stage) for i in chunk}
    names = (() if stage == 0 else whole.EMBEDDINGS) + (() if stage == pp - 1 else whole.HEAD)
    dropped = [whole.blocks[i] for i in range(len(whole.blocks)) if i not in kept]
    dropped += [getattr(whole, name) for name in names]
    return copy.deepcopy(whole, memo={id(part): part for part in dropped})


@functools.lru_cache(maxsize=16)
def _whole(model: ModelConfig) -> nn.Module:
    """The whole model on the meta device, built for one rank (the layout's attention and sequence
    strategies hold no parameters)."""
    return shape_model(RunConfig(model=model), shape_mesh(Layout.of(1), 0)).to("meta")  # (buffers too)
