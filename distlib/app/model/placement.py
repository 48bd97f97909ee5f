"""A rank's part of the model: what its layout builds, cut to its pipeline chunks and its tensor-
parallel shards. The trainer builds it with weights (``rank_build.build``); the planner builds the same
on the meta device (shapes only, ``distlib.app.plan``), so both hold what the one function cut."""

from __future__ import annotations

import dataclasses

import torch

from distlib.app.config.run import RunConfig
from distlib.app.model import expert_loads, families, strategies
from distlib.app.model.layers import CausalLM
from distlib.app.model.pipeline_step import split_model_
from distlib.comm.mesh import Mesh


def layout_model(cfg: RunConfig, mesh: Mesh, seed: int) -> CausalLM:
    """The whole model of ``model.family``, built for the layout's attention and sequence strategies
    (the weights do not depend on them), initialised from ``seed`` on the CPU."""
    return families.build(cfg.model, seed, _strategies(cfg, mesh))


def shape_model(cfg: RunConfig, mesh: Mesh, loads: expert_loads.Loads = expert_loads.BALANCED) -> CausalLM:
    """``layout_model``'s modules and parameter shapes on the meta device: no weights drawn, and
    the experts' loads (no values to read there) balanced, or the hottest (``expert_loads``)."""
    shaped = dataclasses.replace(_strategies(cfg, mesh), loads=loads)
    with torch.device("meta"):
        return families.CLASSES[cfg.model.family](cfg.model, strategies=shaped)


def _strategies(cfg: RunConfig, mesh: Mesh) -> strategies.Strategies:
    return strategies.for_layout(mesh, cfg.dist.cp_impl, cfg.dist.sp)


def place_model_(model: CausalLM, cfg: RunConfig, mesh: Mesh) -> tuple[list | None, dict]:
    """Cut ``model`` to this rank's pipeline chunks (None at pp = 1) and swap its Linear layers for
    this rank's tensor-parallel shards; returns the chunks and the split parameters' Splits."""
    chunks = split_model_(model, cfg.dist, mesh)
    tp_splits = families.shard_model_(model, mesh.tp)  # name -> Split (none at tp=1)
    families.join_batch_(model, mesh.batch)  # mixtral: experts' loads counted over the dp x cp ranks
    return chunks, tp_splits


def chunk_segments(model: CausalLM, chunks: list | None) -> tuple[tuple[str, ...], ...]:
    """The parameter names of each of this rank's pipeline chunks, when it runs more than one
    (interleaved: each chunk's backward runs apart, so ZeRO-2 buckets none across two); () else."""
    if not chunks or len(chunks) == 1:
        return ()
    name = {id(p): n for n, p in model.named_parameters()}
    return tuple(tuple(name[id(p)] for p in chunk.parameters()) for chunk in chunks)
