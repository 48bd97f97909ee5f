"""What a rank trains: its model, initialised, broadcast, cut to its pipeline stage and tensor-parallel
shards, and the ZeRO optimizer over it. The trainer builds it (and a fresh one for the resume
check); the planner builds the same on the meta device without weights (``plan.states``,
``plan.step_peak``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from distlib.app.config.run import RunConfig
from distlib.app.model.layers import CausalLM
from distlib.app.model.placement import chunk_segments, layout_model, place_model_
from distlib.app.observe.live_bytes import StepMeter
from distlib.app.optimizer import build_optimizer
from distlib.comm.group import Comm
from distlib.comm.mesh import Mesh
from distlib.parallel.broadcast import broadcast_module_
from distlib.parallel.zero import ZeroOptimizer


class Built(NamedTuple):
    model: CausalLM
    optimizer: ZeroOptimizer
    chunks: list | None  # this pipeline rank's chunks (None at pp=1)
    splits: dict  # tensor-parallel cuts, parameter name -> Split (none at tp=1)
    names: list[str]  # every parameter of this stage, before expert parallelism keeps this rank's


def build(
    cfg: RunConfig, comm: Comm, mesh: Mesh, device: torch.device, seed: int, meter: StepMeter | None = None
) -> Built:
    """The model initialised from ``seed``, broadcast from rank 0, cut to this rank's pipeline
    stage, its Linear layers swapped for this rank's tensor-parallel shards, and its optimizer
    (``optimizer.build_optimizer``); with ``meter`` (metrics.step_peak) every tensor it makes is
    counted from here on."""
    if meter is not None:
        return meter.build(build, cfg, comm, mesh, device, seed)
    model = layout_model(cfg, mesh, seed).to(device)  # model.family's class, for the layout
    broadcast_module_(model, comm)
    chunks, tp_splits = place_model_(model, cfg, mesh)  # this rank's stage and shards
    names = [n for n, _ in model.named_parameters()]
    segments = chunk_segments(model, chunks)  # (interleaved: no gradient bucket spans two chunks)
    optimizer = build_optimizer(cfg, model, mesh, tp_splits, segments)  # ZeRO over its groups
    return Built(model, optimizer, chunks, tp_splits, names)
