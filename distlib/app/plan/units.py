"""One unit of the planner's dry step (``activations`` composes a step of them): one micro-batch
of the trainer's own step program through a chunk of a model's blocks at its place in a pipeline
(or a whole shallow model), on the meta device over the mesh's dry groups, the rank's experts
kept as the run's optimizer keeps them, with what it keeps for its backward, computes and sends;
and the routing count's once-a-step part, the count of no micro-batch. ``Rank`` is what a unit
depends on besides its rows, blocks and place, so layouts, stages and schedules share units."""

from __future__ import annotations

import dataclasses
import functools

import torch

from distlib.app.config.groups import TrainConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.operation import DistConfig
from distlib.app.config.run import RunConfig
from distlib.app.model import expert_loads, families, routing_count
from distlib.app.model.local_step import LocalStep
from distlib.app.model.pipeline_step import PipelineStep
from distlib.app.model.placement import place_model_, shape_model
from distlib.app.model.routing_count import RoutingCount
from distlib.app.plan.dry_inputs import cpu_results, low_precision_on_cpu, micro_batch
from distlib.app.plan.timing import Counted, OpCounter, grouped
from distlib.comm import tally
from distlib.comm.mesh import shape_mesh


def _shallow(model: ModelConfig, blocks: int, stages: int, where: str, dense: int | None) -> ModelConfig:
    """``model`` cut to ``stages`` stages of ``blocks`` blocks; where its blocks differ, those
    before the stage run (``where``) dense, then ``dense`` of the stage's own."""
    if dense is None:
        return dataclasses.replace(model, n_layers=blocks * stages)
    before = 0 if where in ("only", "first") else blocks
    return dataclasses.replace(model, n_layers=blocks * stages, first_k_dense_replace=before + dense)


@dataclasses.dataclass(frozen=True)
class Rank:
    """What a run depends on besides its rows, blocks and place: the model, the degrees that shape
    a rank's tensors (not the data parallelism, the schedule or the transport), the dtype, the seed
    (the dropout keys), the CPU's kernels (in bf16 they keep otherwise), document masks, whether
    the experts' routing is counted before the step (its balance then charges every block), and
    whether the unit is timed: its backward runs; else (bytes alone: what the forward keeps for
    it) a pipeline chunk's does still, its schedule whole."""

    model: ModelConfig
    dist: DistConfig
    dtype: str
    seed: int
    cpu: bool
    documents: bool
    counted: bool = False
    loads: expert_loads.Loads = expert_loads.BALANCED  # the experts' (``activations.memory_loads``)
    timed: bool = True

    @staticmethod
    def of(cfg: RunConfig, loads: expert_loads.Loads = expert_loads.BALANCED, timed: bool = True) -> Rank:
        cpu = low_precision_on_cpu(cfg)
        dist = _shape(cfg.dist, cfg.layout.stage().world_size if cfg.model.has_experts else None)
        counted = routing_count.counted(cfg)
        documents = cfg.data.document_mask
        return Rank(cfg.model, dist, cfg.train.dtype, cfg.seed, cpu, documents, counted, loads, timed)


@functools.lru_cache(maxsize=1024)
def _shape(d: DistConfig, stage_ranks: int | None) -> DistConfig:
    """The degrees of ``d`` that shape a rank's tensors and calls, on one data-parallel rank; with
    experts (``stage_ranks``: the ranks of one pipeline stage) on all of one stage's: the expert
    group, and the batch group their balance loss all-reduces its counts over."""
    if stage_ranks is not None:
        return DistConfig(tp=d.tp, cp=d.cp, cp_impl=d.cp_impl, sp=d.sp, ep=d.ep, world_size=stage_ranks)
    return DistConfig(tp=d.tp, cp=d.cp, cp_impl=d.cp_impl, sp=d.sp, world_size=d.tp * d.cp)


@functools.lru_cache(maxsize=4096)
def run(
    rank: Rank, micro: int, blocks: int, where: str, dense: int | None = None
) -> tuple[int, Counted, int]:
    """One micro-batch of the trainer's own step program through a chunk of ``blocks`` blocks at
    ``where`` (first, middle or last global stage of a pipeline of such chunks; only: a whole
    model of ``blocks`` blocks at pp = 1), ``dense`` of them dense first where blocks differ, on
    the meta device: the bytes it keeps for its backward, as the run measures them, what it
    computed and sent, and its parameters' gradient bytes. Where the experts' routing is counted
    before the step, the count of its micro-batch comes first, as the trainer runs it."""
    cfg, mesh, module, chunks = _built(rank, blocks, where, dense)
    batch = micro_batch(cfg.model.seq_len, micro, mesh, rank.seed, rank.documents)
    program = PipelineStep(cfg, mesh, module, chunks, "meta") if chunks else LocalStep(module, 1, "meta")
    ops = _counter(rank)
    with tally.tallied() as calls, ops:
        if rank.counted:
            RoutingCount.counter(module, mesh, program, 1, torch.device("meta")).count([batch])
        if rank.timed or chunks:
            program.run([batch])
        else:  # the bytes alone: what the forward kept (the backward took half of such a unit's time)
            program.kept([batch])
    grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    module.zero_grad(set_to_none=True)  # (the next run of this build starts without: no accumulating add)
    return program.activation_peak, Counted(ops.flops, ops.ops, ops.written, grouped(calls)), grads


@functools.lru_cache(maxsize=1024)
def counted_once(rank: Rank, blocks: int, where: str, dense: int | None = None) -> Counted:
    """The routing count of no micro-batch on a unit's model: what it does once a step."""
    return once(rank, *_built(rank, blocks, where, dense))


def once(rank: Rank, cfg: RunConfig, mesh, module, chunks) -> Counted:
    program = PipelineStep(cfg, mesh, module, chunks, "meta") if chunks else LocalStep(module, 1, "meta")
    ops = _counter(rank)
    with tally.tallied() as calls, ops:
        RoutingCount.counter(module, mesh, program, 1, torch.device("meta")).count([])
    return Counted(ops.flops, ops.ops, ops.written, grouped(calls))


@functools.lru_cache(maxsize=256)
def _built(rank: Rank, blocks: int, where: str, dense: int | None = None) -> tuple:
    """A unit's configuration, its rank's mesh, and its model cut to the rank's chunks (``run``)
    with its parameters in the compute dtype, as the optimizer's flat buffer holds them. Built
    once for the runs of every micro-batch size: a step leaves no state that shapes the next."""
    stages = {"only": 1, "first": 2, "last": 2, "middle": 3}[where]
    model, dist = _shallow(rank.model, blocks, stages, where, dense), rank.dist
    if where != "only":
        dist = dataclasses.replace(dist, pp=stages, pp_schedule="gpipe", world_size=dist.world_size * stages)
    stage = {"only": 0, "first": 0, "middle": 1, "last": stages - 1}[where]
    cfg = RunConfig(model=model, dist=dist, train=TrainConfig(dtype=rank.dtype, grad_accum=1))
    mesh, module, chunks = placed(cfg, stage, rank.loads)
    for p in module.parameters():
        p.data = torch.empty(p.shape, dtype=cfg.param_dtype, device="meta")
    return cfg, mesh, module, chunks


def placed(cfg: RunConfig, stage: int, loads: expert_loads.Loads = expert_loads.BALANCED) -> tuple:
    """The mesh of ``cfg``'s pipeline stage ``stage`` (its first rank) and its model on the meta
    device with the experts' ``loads``, cut to the stage's chunks and its own experts."""
    mesh = shape_mesh(cfg.layout, cfg.layout.rank(pp=stage))
    module = shape_model(cfg, mesh, loads).to("meta")  # (buffers drawn on the CPU move too)
    chunks, _ = place_model_(module, cfg, mesh)
    if mesh.ep is not None:  # (the optimizer's build drops the others' in the run: param_groups_)
        families.hold_experts_(module, mesh.ep)
    return mesh, module, chunks


# the units' operators answered from memory, and their counts (``OpCounter``), per kernels: the
# meta device's alone, or the CPU's for a low precision (``dry_inputs.cpu_results``)
_COUNTED: dict[bool, dict] = {}


def _counter(rank: Rank) -> OpCounter:
    return OpCounter(_COUNTED.setdefault(rank.cpu, {}), cpu_results if rank.cpu else None)
