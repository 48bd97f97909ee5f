"""The bytes a rank's step keeps for its backward, predicted by running the trainer's own step
program on the meta device: the memory table's "activations" figure (the ``ActivationMeter`` of
``LocalStep``, or at pp > 1 the pipeline ``Recorder``'s peak over the in-flight micro-batches).

The planner builds a rank's model as ``states`` does, gives its parameters the compute dtype as
the optimizer does, and runs one micro-batch of ``LocalStep`` or ``PipelineStep`` on the meta
device (shapes only, no arithmetic) over the mesh's dry groups (``Comm.dry``: a tensor-parallel
all-reduce, a sequence-parallel gather, a context-parallel all-to-all or ring message, a pipeline
send moves nothing and a receive has a real one's shape), with the batch the trainer would hand
it: the micro-batch's rows, the context-parallel rank's chunks and positions
(``data.batches.held_tokens``), the dropout keys.

A step is composed of such units: every micro-batch of a step has the same shapes, so it keeps,
computes and sends what the first does (``train.grad_accum`` times over), and a pipeline chunk's
unit depends only on how many blocks it holds and whether it is the first global stage (the
embeddings), the last (the head and the loss) or one between -- a dense model's blocks are alike --
so a chunk of k blocks runs as one stage of an (n_layers / k)-stage pipeline, and layouts, stages
and schedules share it. A pipeline rank's peak is its schedule's most in-flight chunk forwards at
once, each holding its unit's bytes, as the ``Recorder`` adds them up; its sends are the
schedule's. ``tests/test_plan_compose.py`` checks the composition against the whole step program.

Models with experts run with balanced loads (``expert_loads``: the meta device has no routing to
read): to the byte with every expert on the rank (what each keeps is its own rows', and they add up
to the assignments whatever the router chose), an estimate over expert-parallel ranks or with a
capacity (``routing_estimated``). Where the experts' routing is counted before the step (balanced by
their biases, or by the loss over several micro-batches or stages: ``routing_count``) each unit runs
the count of its micro-batch first, as the trainer does, and its blocks keep what the step's
balance charges; what the count does once a step (its all-reduce, the balance it sets), each unit
did for its own micro-batch, so the step takes each unit's off (``_count_once``: the count of no
micro-batch) and adds the stage's own once (``_stage_once``: sized by the whole model's blocks,
all-reduced over the stages too), with the sends of the count's forwards (the schedule's). Where a
model's blocks differ (DeepSeek-V3's first dense ones) a pipeline chunk runs whole, its dense
blocks first as in the model. Not predicted (None): document masks over context-parallel ranks
(the chunks a rank holds follow the documents).
At cp = 1 a mask's shape is all that counts: the dry step's documents are shapes only, and the
document-mask matrix (tests/test_document_mask_train.py) checks them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from distlib.app.config.groups import TrainConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.operation import DistConfig
from distlib.app.config.run import RunConfig
from distlib.app.data.batches import BatchPlan
from distlib.app.model import routing_count
from distlib.app.model.local_step import LocalStep
from distlib.app.model.pipeline_step import PipelineStep
from distlib.app.model.placement import place_model_, shape_model
from distlib.app.model.routing_count import RoutingCount
from distlib.app.plan.composition import (
    added,
    extended,
    holds,
    less,
    micro_batches,
    one_step,
    send_bytes,
    sends,
    stepped,
    without_sends,
)
from distlib.app.plan.dry_inputs import cpu_results, low_precision_on_cpu, micro_batch
from distlib.app.plan.timing import Counted, OpCounter, grouped
from distlib.comm import tally
from distlib.comm.mesh import shape_mesh
from distlib.parallel.pipeline import schedule


def predicted(cfg: RunConfig) -> bool:
    """Whether the activations (and so the step time) of ``cfg`` are predicted: not with document
    masks over context-parallel ranks (the chunks each holds follow the documents)."""
    return not (cfg.data.document_mask and cfg.dist.cp > 1)


def routing_estimated(cfg: RunConfig) -> bool:
    """Whether what the experts hold is an estimate: the dry step's loads are balanced
    (``expert_loads``), which is the run's to the byte with every expert on the rank and nothing
    dropped, and an estimate over expert-parallel ranks (a rank holds what the router sends its
    experts) or with a capacity (the run drops what an unbalanced router sends over it)."""
    model = cfg.model
    return model.has_experts and (cfg.dist.ep > 1 or model.capacity_factor is not None)


def blocks_alike(model: ModelConfig) -> bool:
    """Whether every block of ``model`` is built alike (all or none of them mixtures of experts)."""
    return len(model.moe_layers) in (0, model.n_layers)


def rank_activations(cfg: RunConfig) -> list[int | None]:
    """What each rank's step keeps for its backward, in rank order (None: not predicted, the
    module's docstring). The ranks of one pipeline stage hold the same shapes."""
    if not predicted(cfg):
        return [None] * cfg.dist.world_size
    stages = [stage_step(cfg, s)[0] for s in range(cfg.dist.pp)]
    layout = cfg.layout
    return [stages[layout.coords(rank)["pp"]] for rank in range(layout.world_size)]


def stage_counts(cfg: RunConfig) -> list[Counted] | None:
    """Per pipeline stage, what its first rank's step computes and sends (``timing.Counted``),
    from the same units; None where the activations are not predicted."""
    if not predicted(cfg):
        return None
    return [stage_step(cfg, s)[1] for s in range(cfg.dist.pp)]


def stage_step(cfg: RunConfig, stage: int) -> tuple[int, Counted]:
    """Pipeline stage ``stage``'s activation peak and its step's counts, composed of its units."""
    d = cfg.dist
    micro = BatchPlan(cfg.global_batch, cfg.dp_size, cfg.train.grad_accum).micro_batch
    return _stage(_Rank.of(cfg), micro, d.pp, d.pp_virtual, d.pp_schedule, cfg.train.grad_accum, stage)


@functools.lru_cache(maxsize=4096)
def _stage(rank: _Rank, micro: int, P: int, v: int, name: str, m: int, stage: int) -> tuple[int, Counted]:
    """Pipeline stage ``stage`` of ``P`` (``v`` chunks a rank, schedule ``name``, ``m``
    micro-batches of ``micro`` rows): its activation peak and its step's counts."""
    n_layers = rank.model.n_layers
    if P == 1:
        peak, unit, grads = _chunk(rank, micro, n_layers, "only")
        step = one_step([micro_batches(unit, m, grads)], m)
        return peak, less(step, _count_once(rank, n_layers), m - 1) if rank.counted else step
    per = n_layers // (P * v)
    places = [schedule.stage_of(stage, c, P) for c in range(v)]  # each chunk's among all P x v
    units = [_chunk(rank, micro, per, _position(g, P * v), _dense(rank.model, g, per)) for g in places]
    actions = schedule.build(name, P, m, v)[stage]
    live = peak = 0
    for a in actions:  # the Recorder's sum: each chunk forward's bytes, held until its backward
        live += units[a.chunk][0] if a.kind == "F" else -units[a.chunk][0]
        peak = max(peak, live)
    counted = [micro_batches(without_sends(unit), m, grads) for _, unit, grads in units]
    nbytes = send_bytes(units)
    step = one_step(counted, v * m, sends(actions, stage, P, v, nbytes))
    if not rank.counted:
        return peak, step
    for g in places:  # each unit's count did its share once for its micro-batch: the stage's does it once
        step = less(step, _count_once(rank, per, _position(g, P * v), _dense(rank.model, g, per)), m)
    # the loss's count runs the step's forwards first, sending as they do (the biases' count none)
    forwards = [a for a in actions if a.kind == "F"] if rank.model.balance != "bias" else []
    return peak, one_step([step, _stage_once(rank, P, v, stage)], 1, sends(forwards, stage, P, v, nbytes))


def _position(stage: int, stages: int) -> str:
    return "first" if stage == 0 else "last" if stage == stages - 1 else "middle"


def _shallow(model: ModelConfig, blocks: int, stages: int, where: str, dense: int | None) -> ModelConfig:
    """``model`` cut to ``stages`` stages of ``blocks`` blocks; where its blocks differ, those
    before the stage run (``where``) dense, then ``dense`` of the stage's own."""
    if dense is None:
        return dataclasses.replace(model, n_layers=blocks * stages)
    before = 0 if where in ("only", "first") else blocks
    return dataclasses.replace(model, n_layers=blocks * stages, first_k_dense_replace=before + dense)


def _dense(model: ModelConfig, chunk: int, per: int) -> int | None:
    """How many of chunk ``chunk``'s ``per`` blocks are dense where a model's blocks differ
    (DeepSeek-V3's first ``first_k_dense_replace``); None where they are alike."""
    if blocks_alike(model):
        return None
    return min(max(model.first_k_dense_replace - chunk * per, 0), per)


@dataclasses.dataclass(frozen=True)
class _Rank:
    """What a run depends on besides its rows, blocks and place: the model, the degrees that shape
    a rank's tensors (not the data parallelism, the schedule or the transport), the dtype, the seed
    (the dropout keys), the CPU's kernels (in bf16 they keep otherwise), document masks, whether
    the experts' routing is counted before the step (its balance then charges every block)."""

    model: ModelConfig
    dist: DistConfig
    dtype: str
    seed: int
    cpu: bool
    documents: bool
    counted: bool = False

    @staticmethod
    def of(cfg: RunConfig) -> _Rank:
        cpu = low_precision_on_cpu(cfg)
        dist = _shape(cfg.dist, cfg.layout.stage().world_size if cfg.model.has_experts else None)
        counted = routing_count.counted(cfg)
        return _Rank(cfg.model, dist, cfg.train.dtype, cfg.seed, cpu, cfg.data.document_mask, counted)


@functools.lru_cache(maxsize=1024)
def _shape(d: DistConfig, stage_ranks: int | None) -> DistConfig:
    """The degrees of ``d`` that shape a rank's tensors and calls, on one data-parallel rank; with
    experts (``stage_ranks``: the ranks of one pipeline stage) on all of one stage's: the expert
    group, and the batch group their balance loss all-reduces its counts over."""
    if stage_ranks is not None:
        return DistConfig(tp=d.tp, cp=d.cp, cp_impl=d.cp_impl, sp=d.sp, ep=d.ep, world_size=stage_ranks)
    return DistConfig(tp=d.tp, cp=d.cp, cp_impl=d.cp_impl, sp=d.sp, world_size=d.tp * d.cp)


def _chunk(
    rank: _Rank, micro: int, blocks: int, where: str, dense: int | None = None
) -> tuple[int, Counted, int]:
    """A chunk of ``blocks`` blocks at ``where`` with ``micro`` rows, as ``_run`` would give it:
    from the runs of one and two blocks, each block more adding what the second added (every
    byte, operator and call of a dense model's blocks is alike), so a deep model's chunks cost two
    shallow runs. Unlike blocks (``dense`` of them dense, then the experts') run as the chunk."""
    if blocks <= 2 or not blocks_alike(rank.model):
        return _rows(rank, micro, blocks, where, dense)
    one, two = _rows(rank, micro, 1, where), _rows(rank, micro, 2, where)
    a, b = one[1].calls, two[1].calls
    calls = added(a, b, blocks - 1) if holds(b, a) else stepped(a, b, blocks - 1)
    if calls is None:
        return _rows(rank, micro, blocks, where)  # the second block dropped or changed a call: not alike
    return extended(one, two, blocks - 1, calls)


def _rows(
    rank: _Rank, micro: int, blocks: int, where: str, dense: int | None = None
) -> tuple[int, Counted, int]:
    """``_run`` with ``micro`` rows, from the runs of two and three: every row more adds what the
    third added (its bytes, FLOPs, message bytes and its dropout draws' operators); one row runs
    as itself (a single row reshapes by views where more copy), so every micro-batch size costs
    at most three runs."""
    if micro <= 3:
        return _run(rank, micro, blocks, where, dense)
    two, three = _run(rank, 2, blocks, where, dense), _run(rank, 3, blocks, where, dense)
    if [c[:1] + c[2:] for c in two[1].calls] != [c[:1] + c[2:] for c in three[1].calls]:
        return _run(rank, micro, blocks, where, dense)  # a row more changed which calls run: not alike
    return extended(two, three, micro - 2, stepped(two[1].calls, three[1].calls, micro - 2))


@functools.lru_cache(maxsize=4096)
def _run(
    rank: _Rank, micro: int, blocks: int, where: str, dense: int | None = None
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
        program.run([batch])
    grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return program.activation_peak, Counted(ops.flops, ops.ops, ops.written, grouped(calls)), grads


def _count_once(rank: _Rank, blocks: int, where: str = "only", dense: int | None = None) -> Counted:
    """What the routing count does once a step however many micro-batches it counts (its
    all-reduce of the counts and the balance it sets; a bias's counts zeroed), as a unit of
    ``blocks`` blocks at ``where`` did it for its own micro-batch: from one and two blocks, each
    block more adding what the second added, like the units' (unlike blocks: run as the chunk)."""
    if blocks <= 2 or not blocks_alike(rank.model):
        return _counted_once(rank, blocks, where, dense)
    one, two = _counted_once(rank, 1, where), _counted_once(rank, 2, where)
    calls = stepped(one.calls, two.calls, blocks - 1)
    if calls is None:
        return _counted_once(rank, blocks, where)
    return extended((0, one, 0), (0, two, 0), blocks - 1, calls)[1]


@functools.lru_cache(maxsize=1024)
def _counted_once(rank: _Rank, blocks: int, where: str, dense: int | None = None) -> Counted:
    """The routing count of no micro-batch on a unit's model: what it does once a step."""
    return _once(rank, *_built(rank, blocks, where, dense))


@functools.lru_cache(maxsize=1024)
def _stage_once(rank: _Rank, P: int, v: int, stage: int) -> Counted:
    """The routing count of no micro-batch on pipeline stage ``stage`` of the whole model (its
    counts sized by every block, all-reduced over the batch ranks and the ``P`` stages)."""
    schedule_name = "interleaved" if v > 1 else "gpipe"
    dist = dataclasses.replace(
        rank.dist, pp=P, pp_virtual=v, pp_schedule=schedule_name, world_size=rank.dist.world_size * P
    )
    # (interleaved: micro-batches a multiple of the stages; one row each, so any batch divides)
    train = TrainConfig(dtype=rank.dtype, grad_accum=P if v > 1 else 1, global_batch=None, batch_size=1)
    cfg = RunConfig(model=rank.model, dist=dist, train=train)
    return _once(rank, cfg, *_placed(cfg, stage))


def _once(rank: _Rank, cfg: RunConfig, mesh, module, chunks) -> Counted:
    program = PipelineStep(cfg, mesh, module, chunks, "meta") if chunks else LocalStep(module, 1, "meta")
    ops = _counter(rank)
    with tally.tallied() as calls, ops:
        RoutingCount.counter(module, mesh, program, 1, torch.device("meta")).count([])
    return Counted(ops.flops, ops.ops, ops.written, grouped(calls))


def _built(rank: _Rank, blocks: int, where: str, dense: int | None = None) -> tuple:
    """A unit's configuration, its rank's mesh, and its model cut to the rank's chunks (``_run``)
    with its parameters in the compute dtype, as the optimizer's flat buffer holds them."""
    stages = {"only": 1, "first": 2, "last": 2, "middle": 3}[where]
    model, dist = _shallow(rank.model, blocks, stages, where, dense), rank.dist
    if where != "only":
        dist = dataclasses.replace(dist, pp=stages, pp_schedule="gpipe", world_size=dist.world_size * stages)
    stage = {"only": 0, "first": 0, "middle": 1, "last": stages - 1}[where]
    cfg = RunConfig(model=model, dist=dist, train=TrainConfig(dtype=rank.dtype, grad_accum=1))
    mesh, module, chunks = _placed(cfg, stage)
    for p in module.parameters():
        p.data = torch.empty(p.shape, dtype=cfg.param_dtype, device="meta")
    return cfg, mesh, module, chunks


def _placed(cfg: RunConfig, stage: int) -> tuple:
    """The mesh of ``cfg``'s pipeline stage ``stage`` (its first rank) and its model on the meta
    device, cut to the stage's chunks."""
    mesh = shape_mesh(cfg.layout, cfg.layout.rank(pp=stage))
    module = shape_model(cfg, mesh).to("meta")  # (buffers drawn on the CPU move too)
    chunks, _ = place_model_(module, cfg, mesh)
    return mesh, module, chunks


# the units' operators answered from memory, and their counts (``OpCounter``), per kernels: the
# meta device's alone, or the CPU's for a low precision (``dry_inputs.cpu_results``)
_COUNTED: dict[bool, dict] = {}


def _counter(rank: _Rank) -> OpCounter:
    return OpCounter(_COUNTED.setdefault(rank.cpu, {}), cpu_results if rank.cpu else None)
