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
from distlib.parallel.adamw import AdamWConfig
from distlib.parallel.expert_parallel import expert_grad_scale
from distlib.parallel.zero import ParamGroup, ZeroOptimizer, make_optimizer

DENSE, EXPERTS = "dense", "experts"  # the parameter groups' names (a checkpoint's "experts." keys)


def build_optimizer(cfg: RunConfig, model: CausalLM, mesh: Mesh, tp_splits):
    """``model``'s optimizer (this rank's pipeline stage and tensor-parallel shards of it)."""
    z, opt = cfg.zero, cfg.optimizer
    options = dict(
        tp=mesh.tp,
        tp_split=tp_splits,
        tp_partial=families.partial_over_tp(model, mesh.tp),  # summed over tp per step
        param_dtype=cfg.param_dtype,
        bucket_numel=z.bucket_numel,
        overlap=z.overlap,
        grad_accum=cfg.train.grad_accum,
        pp=mesh.pp,
    )
    if mesh.ep is not None:  # this rank keeps its experts; ZeRO over the dense and expert groups
        return expert_parallel_optimizer(model, mesh, z.stage, opt.adamw, opt.grad_clip, **options)
    # gradients average over dp x cp; ZeRO shards there
    return make_optimizer(model, mesh.batch, z.stage, opt.adamw, opt.grad_clip, **options)


def expert_parallel_optimizer(
    model: CausalLM, mesh: Mesh, stage: int, cfg: AdamWConfig, grad_clip: float, **options
) -> ZeroOptimizer:
    """Drop the experts other ranks of ``mesh.ep`` hold from ``model`` (built whole, the same on
    every rank) and return its optimizer; ``options`` as ``make_optimizer``'s."""
    ep, names = mesh.ep, [n for n, _ in model.named_parameters()]
    kept = families.hold_experts_(model, ep)
    groups = [
        ParamGroup(DENSE, tuple(n for n in names if moe.expert_of(n) is None), mesh.batch),
        ParamGroup(EXPERTS, kept, mesh.expert_dp, (ep,), expert_grad_scale(ep)),
    ]
    return ZeroOptimizer(model, groups, stage, cfg, grad_clip, **options)
