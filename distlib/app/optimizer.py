"""The optimizer a run's layout needs, built by the application (the model package builds none):
ZeRO (``zero.stage``) over parameter groups (``parallel.zero.optimizer``), one group over the batch
ranks dp x cp, or, with expert parallelism (``dist.ep``), two: the dense parameters over the batch ranks,
the experts over the ranks holding the same ones, their gradients scaled by 1/ep
(``expert_parallel``). Each rank's checkpoint shard holds what it holds (the dense partition, and
its experts' under "experts."), and the manifest says where every expert is, so a checkpoint of
any ep loads at any other by name (``checkpoint.relayout``)."""

from __future__ import annotations

from distlib.app.config.run import RunConfig
from distlib.app.model import families, moe
from distlib.app.model.layers import CausalLM
from distlib.comm.mesh import Mesh
from distlib.comm.progress import Progress
from distlib.parallel.expert_parallel import expert_grad_scale
from distlib.parallel.zero import PARAMS, ParamGroup, ZeroOptimizer

DENSE, EXPERTS = "dense", "experts"  # the parameter groups' names (a checkpoint's "experts." keys)


def build_optimizer(cfg: RunConfig, model: CausalLM, mesh: Mesh, tp_splits, segments=(), queue=Progress):
    """``model``'s optimizer (this rank's pipeline stage and tensor-parallel shards of it;
    ``segments``: its chunks' parameter names, ``placement.chunk_segments``; ``queue``: what makes
    ``zero.overlap``'s queue of jobs, ``ZeroOptimizer``'s)."""
    z, opt = cfg.zero, cfg.optimizer
    options = dict(
        tp=mesh.tp,
        tp_split=tp_splits,
        tp_partial=families.partial_over_tp(model, mesh.tp),  # summed over tp per step
        param_dtype=cfg.param_dtype,
        bucket_numel=z.bucket_numel,
        segments=segments,
        overlap=z.overlap,
        grad_accum=cfg.train.grad_accum,
        pp=mesh.pp,
        queue=queue,
    )
    return ZeroOptimizer(model, param_groups_(model, mesh), z.stage, opt.adamw, opt.grad_clip, **options)


def param_groups_(model: CausalLM, mesh: Mesh) -> list[ParamGroup]:
    """The groups ZeRO runs over: every parameter over the batch ranks dp x cp, or, with expert
    parallelism, the dense ones there and this rank's experts over the ranks holding the same
    ones (the other ranks' experts dropped from ``model``, built whole, the same on every rank)."""
    names = tuple(n for n, _ in model.named_parameters())
    if mesh.ep is None:  # gradients average over dp x cp; ZeRO shards there
        return [ParamGroup(PARAMS, names, mesh.batch)]
    ep = mesh.ep
    kept = families.hold_experts_(model, ep)
    return [
        ParamGroup(DENSE, tuple(n for n in names if moe.expert_of(n) is None), mesh.batch),
        ParamGroup(EXPERTS, kept, mesh.expert_dp, (ep,), expert_grad_scale(ep)),
    ]
