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

A unit (``units``) holds the rank's own experts as the run's optimizer leaves them, and models with
experts run with balanced loads (``expert_loads``: the meta device has no routing to read): to the
byte with every expert on the rank (what each keeps is its own rows', and they add up to the
assignments whatever the router chose), and what a balanced router gives over expert-parallel
ranks: there the step's time takes them, its bytes the experts' hottest loads (``memory_loads``:
the most any routing sends the rank's experts), a bound (``bounded``; with a capacity the dry step
keeps every assignment, a bound too); those units want bytes alone, so at pp = 1 their forwards
run without the backwards (``Rank.timed``: qwen3_moe's 86 such units took 1.13 s, 2.24 with).
Where the experts' routing is counted before the step (balanced by their biases, or by the loss
over several micro-batches or stages: ``routing_count``) each unit runs the count of its
micro-batch first, as the trainer does, and its blocks keep what the step's
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

from distlib.app.config.groups import TrainConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.run import RunConfig
from distlib.app.data.batches import BatchPlan
from distlib.app.model import expert_loads
from distlib.app.plan import units
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
from distlib.app.plan.timing import Counted
from distlib.app.plan.units import Rank
from distlib.parallel.pipeline import schedule


def predicted(cfg: RunConfig) -> bool:
    """Whether the activations (and so the step time) of ``cfg`` are predicted: not with document
    masks over context-parallel ranks (the chunks each holds follow the documents)."""
    return not (cfg.data.document_mask and cfg.dist.cp > 1)


def bounded(cfg: RunConfig) -> bool:
    """Whether the predicted activations are a bound, at or over the run's (else its bytes): with
    experts over expert-parallel ranks (a rank keeps what the router sends its experts: predicted
    with the hottest loads, ``memory_loads``), or with a capacity (the dry step keeps every
    assignment, where the run drops what its router sends an expert over it)."""
    model = cfg.model
    return model.has_experts and (cfg.dist.ep > 1 or model.capacity_factor is not None)


def missed(cfg: RunConfig, measured: int, planned: int) -> bool:
    """Whether a rank's measured activations are not the planned: other bytes, or over a bound."""
    return measured > planned if bounded(cfg) else measured != planned


def blocks_alike(model: ModelConfig) -> bool:
    """Whether every block of ``model`` is built alike (all or none of them mixtures of experts)."""
    return len(model.moe_layers) in (0, model.n_layers)


def rank_activations(cfg: RunConfig) -> list[int | None]:
    """What each rank's step keeps for its backward, in rank order (None: not predicted, the
    module's docstring). The ranks of one pipeline stage hold the same shapes."""
    if not predicted(cfg):
        return [None] * cfg.dist.world_size
    stages = [stage_peak(cfg, s) for s in range(cfg.dist.pp)]
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
    return _stage(*_composing(cfg, Rank.of(cfg)), stage)


def stage_peak(cfg: RunConfig, stage: int) -> int:
    """Pipeline stage ``stage``'s activation peak: ``stage_step``'s, but over expert-parallel
    ranks with the experts' hottest loads (``memory_loads``), a bound."""
    loads = memory_loads(cfg)
    if loads is expert_loads.BALANCED:
        return stage_step(cfg, stage)[0]  # (the units the step's time runs)
    return _peak(*_composing(cfg, Rank.of(cfg, loads, timed=False)), stage)  # (bytes alone)


def _composing(cfg: RunConfig, rank: Rank) -> tuple:
    """What a stage's composition depends on: the units' rank, the micro-batch's rows, the stages,
    the chunks of a rank, the schedule and the micro-batches of a step."""
    d = cfg.dist
    micro = BatchPlan(cfg.global_batch, cfg.dp_size, cfg.train.grad_accum).micro_batch
    return rank, micro, d.pp, d.pp_virtual, d.pp_schedule, cfg.train.grad_accum


def memory_loads(cfg: RunConfig) -> expert_loads.Loads:
    """The experts' loads a rank's bytes are predicted with: balanced with every expert on the
    rank (the kept bytes are the same for every routing there), else the hottest (a bound)."""
    return expert_loads.HOTTEST if cfg.model.has_experts and cfg.dist.ep > 1 else expert_loads.BALANCED


@functools.lru_cache(maxsize=4096)
def _peak(rank: Rank, micro: int, P: int, v: int, name: str, m: int, stage: int) -> int:
    """``_stage``'s activation peak alone."""
    if P == 1:
        return _chunk(rank, micro, rank.model.n_layers, "only")[0]
    return _in_flight(_units(rank, micro, P, v, stage), schedule.build(name, P, m, v)[stage])


@functools.lru_cache(maxsize=4096)
def _stage(rank: Rank, micro: int, P: int, v: int, name: str, m: int, stage: int) -> tuple[int, Counted]:
    """Pipeline stage ``stage`` of ``P`` (``v`` chunks a rank, schedule ``name``, ``m``
    micro-batches of ``micro`` rows): its activation peak and its step's counts."""
    n_layers = rank.model.n_layers
    if P == 1:
        peak, unit, grads = _chunk(rank, micro, n_layers, "only")
        step = one_step([micro_batches(unit, m, grads)], m)
        return peak, less(step, _count_once(rank, n_layers), m - 1) if rank.counted else step
    per = n_layers // (P * v)
    places = [schedule.stage_of(stage, c, P) for c in range(v)]  # each chunk's among all P x v
    made = _units(rank, micro, P, v, stage)
    actions = schedule.build(name, P, m, v)[stage]
    peak = _in_flight(made, actions)
    counted = [micro_batches(without_sends(unit), m, grads) for _, unit, grads in made]
    nbytes = send_bytes(made)
    step = one_step(counted, v * m, sends(actions, stage, P, v, nbytes))
    if not rank.counted:
        return peak, step
    for g in places:  # each unit's count did its share once for its micro-batch: the stage's does it once
        step = less(step, _count_once(rank, per, _position(g, P * v), _dense(rank.model, g, per)), m)
    # the loss's count runs the step's forwards first, sending as they do (the biases' count none)
    forwards = [a for a in actions if a.kind == "F"] if rank.model.balance != "bias" else []
    return peak, one_step([step, _stage_once(rank, P, v, stage)], 1, sends(forwards, stage, P, v, nbytes))


def _units(rank: Rank, micro: int, P: int, v: int, stage: int) -> list[tuple[int, Counted, int]]:
    """The units of pipeline stage ``stage``'s chunks, one per chunk, in the rank's chunk order."""
    per = rank.model.n_layers // (P * v)
    places = [schedule.stage_of(stage, c, P) for c in range(v)]  # each chunk's among all P x v
    return [_chunk(rank, micro, per, _position(g, P * v), _dense(rank.model, g, per)) for g in places]


def _in_flight(units: list[tuple[int, Counted, int]], actions) -> int:
    """The ``Recorder``'s peak: each chunk forward's bytes, held until its backward."""
    live = peak = 0
    for a in actions:
        live += units[a.chunk][0] if a.kind == "F" else -units[a.chunk][0]
        peak = max(peak, live)
    return peak


def _position(stage: int, stages: int) -> str:
    return "first" if stage == 0 else "last" if stage == stages - 1 else "middle"


def _dense(model: ModelConfig, chunk: int, per: int) -> int | None:
    """How many of chunk ``chunk``'s ``per`` blocks are dense where a model's blocks differ
    (DeepSeek-V3's first ``first_k_dense_replace``); None where they are alike."""
    if blocks_alike(model):
        return None
    return min(max(model.first_k_dense_replace - chunk * per, 0), per)


def _chunk(
    rank: Rank, micro: int, blocks: int, where: str, dense: int | None = None
) -> tuple[int, Counted, int]:
    """A chunk of ``blocks`` blocks at ``where`` with ``micro`` rows, as ``units.run`` would give it:
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
    rank: Rank, micro: int, blocks: int, where: str, dense: int | None = None
) -> tuple[int, Counted, int]:
    """``units.run`` with ``micro`` rows, from the runs of two and three: every row more adds what the
    third added (its bytes, FLOPs, message bytes and its dropout draws' operators); one row runs
    as itself (a single row reshapes by views where more copy), so every micro-batch size costs
    at most three runs."""
    if micro <= 3:
        return units.run(rank, micro, blocks, where, dense)
    two, three = units.run(rank, 2, blocks, where, dense), units.run(rank, 3, blocks, where, dense)
    if [c[:1] + c[2:] for c in two[1].calls] != [c[:1] + c[2:] for c in three[1].calls]:
        return units.run(rank, micro, blocks, where, dense)  # a row more changed which calls run: not alike
    return extended(two, three, micro - 2, stepped(two[1].calls, three[1].calls, micro - 2))


def _count_once(rank: Rank, blocks: int, where: str = "only", dense: int | None = None) -> Counted:
    """What the routing count does once a step however many micro-batches it counts (its
    all-reduce of the counts and the balance it sets; a bias's counts zeroed), as a unit of
    ``blocks`` blocks at ``where`` did it for its own micro-batch: from one and two blocks, each
    block more adding what the second added, like the units' (unlike blocks: run as the chunk)."""
    if blocks <= 2 or not blocks_alike(rank.model):
        return units.counted_once(rank, blocks, where, dense)
    one, two = units.counted_once(rank, 1, where), units.counted_once(rank, 2, where)
    calls = stepped(one.calls, two.calls, blocks - 1)
    if calls is None:
        return units.counted_once(rank, blocks, where)
    return extended((0, one, 0), (0, two, 0), blocks - 1, calls)[1]


@functools.lru_cache(maxsize=1024)
def _stage_once(rank: Rank, P: int, v: int, stage: int) -> Counted:
    """The routing count of no micro-batch on pipeline stage ``stage`` of the whole model (its
    counts sized by every block, all-reduced over the batch ranks and the ``P`` stages)."""
    schedule_name = "interleaved" if v > 1 else "gpipe"
    dist = dataclasses.replace(
        rank.dist, pp=P, pp_virtual=v, pp_schedule=schedule_name, world_size=rank.dist.world_size * P
    )
    # (interleaved: micro-batches a multiple of the stages; one row each, so any batch divides)
    train = TrainConfig(dtype=rank.dtype, grad_accum=P if v > 1 else 1, global_batch=None, batch_size=1)
    cfg = RunConfig(model=rank.model, dist=dist, train=train)
    return units.once(rank, cfg, *units.placed(cfg, stage))
