"""The optimizer a run's layout needs, built by the application (the model package builds none):
ZeRO (``zero.stage``) over the batch ranks dp x cp, or, with expert parallelism (``dist.ep``), ZeRO
over two parameter groups (``parallel.zero.groups``): the dense parameters over the batch ranks,
the experts over the ranks holding the same ones, their gradients scaled by 1/ep
(``expert_parallel``). That one saves and loads the state a run without expert parallelism holds
(``zero.expert_state``), so checkpoints do not depend on ep."""

from __future__ import annotations

from distlib.app.config.run import RunConfig
from distlib.app.model import families, moe
from distlib.app.model.layers import CausalLM
from distlib.comm.layout import BATCH
from distlib.comm.mesh import Mesh
from distlib.parallel.adamw import AdamWConfig
from distlib.parallel.expert_parallel import expert_grad_scale, held_experts
from distlib.parallel.flat_layout import FlatLayout
from distlib.parallel.zero import make_optimizer
from distlib.parallel.zero.expert_state import DENSE, EXPERTS, ExpertParallelOptimizer, Plan, sub_layout
from distlib.parallel.zero.groups import GroupedOptimizer, ParamGroup


def build_optimizer(cfg: RunConfig, model: CausalLM, mesh: Mesh, tp_splits):
    """``model``'s optimizer (this rank's pipeline stage and tensor-parallel shards of it)."""
    z, opt = cfg.zero, cfg.optimizer
    options = dict(
        tp=mesh.tp,
        tp_split=tp_splits,
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
) -> ExpertParallelOptimizer:
    """Drop the experts other ranks of ``mesh.ep`` hold from ``model`` (built whole, the same on
    every rank) and return its optimizer; ``options`` as ``make_optimizer``'s."""
    ep, batch = mesh.ep, mesh.batch
    canonical = FlatLayout.of(model, batch.size)  # the whole model: what a checkpoint holds
    names = [n for n, _ in model.named_parameters()]
    by_rank = [
        {n for n in names if moe.expert_of(n) in held_experts(model.cfg.n_experts, ep.size, j)}
        for j in range(ep.size)
    ]
    kept = families.hold_experts_(model, ep)
    groups = [
        ParamGroup(DENSE, tuple(n for n in names if moe.expert_of(n) is None), batch),
        ParamGroup(EXPERTS, kept, mesh.expert_dp, (ep,), expert_grad_scale(ep)),
    ]
    grouped = GroupedOptimizer(model, groups, stage, cfg, grad_clip, **options)
    experts = [sub_layout(canonical, held, mesh.expert_dp.size) for held in by_rank]
    if experts[ep.rank] != grouped.groups[EXPERTS].layout:
        raise RuntimeError("the expert group's layout is not the one the checkpoint plan assumes")
    # every batch rank's place in its expert group and among the ranks holding its experts
    grid = mesh.layout
    places = [(grid.place(r, ("ep",)), grid.place(r, ("edp",))) for r in grid.group(mesh.world.rank, BATCH)]
    plan = Plan(canonical, grouped.groups[DENSE].layout, experts, places)
    return ExpertParallelOptimizer(grouped, plan, batch)
