"""The most bytes of tensors a rank holds at once during a training step, predicted by running the
whole step on the meta device: what ``metrics.step_peak`` measures (``observe.live_bytes``).

The model states and the activations kept for backward (``states``, ``activations``) are what a
step holds between its operators; its peak adds what lives only inside them -- the logits' and
the loss's gradients, an attention's scores, a layer's output gradient beside its input's, a
gradient bucket or a gathered ZeRO-3 unit, the optimizer update's temporary -- and where those meet
depends on the order things run in. So nothing here is a formula: the rank's model and its ZeRO
optimizer are built as ``rank_build.build`` builds them, on the meta device over the mesh's dry groups
(``Comm.dry``: collectives move nothing, a receive has a real one's shape), and one step runs as
the trainer runs it -- its micro-batches through ``LocalStep`` or the pipeline's schedule, the
gradients' sync, the AdamW update, the gradients cleared -- under the same ``LiveBytes`` meter,
from the build on. The run and the prediction count the same storages at the same moments.

A whole step per layout costs a whole model's operators (the tiny presets: 40-140 ms), so the
search ranks by the composed figures and this settles the layouts it shows or picks
(``--layout``, ``--verify``, ``dist.layout=auto``). Exact (``tests/test_plan_states.py``, to the
byte) but with ``zero.overlap`` at stages 2/3, where the communication thread's timing decides
when a bucket's gradients are freed: the dry step's thread is the latest any can be
(``late_frees``), a bound the run reaches or stays under (``timed``); and with experts, where the
router decides how many rows the peak's moment holds: the dry step runs the experts' hottest loads
(``expert_loads.hottest``: the most rows any routing sends the rank's experts, the first of them
the fullest), so the peak is a bound (``bounded``), which a router forced to those loads measures
to the byte (tests/test_plan_hottest.py); where the routing is counted before the step, the count
runs too, the biases' update after it does not.
Not predicted (None): document masks (the run makes each micro-batch's documents where the dry
step has shapes only).
"""

from __future__ import annotations

import functools

import torch

from distlib.app.config.run import RunConfig
from distlib.app.data.batches import BatchPlan
from distlib.app.model import expert_loads, routing_count
from distlib.app.model.local_step import LocalStep
from distlib.app.model.pipeline_step import PipelineStep
from distlib.app.model.placement import chunk_segments, place_model_, shape_model
from distlib.app.observe.live_bytes import LiveBytes
from distlib.app.optimizer import build_optimizer
from distlib.app.plan.dry_inputs import cpu_kernels, micro_batch
from distlib.app.plan.late_frees import LateFrees
from distlib.app.plan.meta_memo import MetaMemo
from distlib.comm.mesh import shape_mesh
from distlib.comm.progress import Progress


def rank_step_peaks(cfg: RunConfig) -> list[int | None]:
    """Each rank's predicted step peak in bytes, in rank order (None: not predicted). The ranks of
    one pipeline stage hold the same shapes at the same moments but where their context-parallel
    coordinate differs (a ring's causal steps differ by rank: 10,240 bytes at gpt2's ring over two)
    or, at ZeRO-2/3, their data-parallel one (a bucket or a unit ends inside one rank's partition
    and not another's: 12,288 bytes at qwen3_tiny's ZeRO-3 over two), so each such place runs."""
    if cfg.data.document_mask:
        return [None] * cfg.dist.world_size
    layout = cfg.layout
    by_dp = cfg.zero.stage >= 2
    places = [
        (c["pp"], c["cp"], c["dp"] if by_dp else 0) for c in map(layout.coords, range(layout.world_size))
    ]
    return [stage_step_peak(cfg, pp, cp, dp) for pp, cp, dp in places]


def exact(cfg: RunConfig) -> bool:
    """Whether the step peak is predicted to the byte: not where it is a bound (``bounded``)."""
    return not bounded(cfg)


def timed(cfg: RunConfig) -> bool:
    """With ``zero.overlap`` at stages 2/3 the communication thread's timing moves the peak: the
    dry step's thread is the latest any could be (``late_frees``), a bound."""
    return cfg.zero.overlap and cfg.zero.stage >= 2


def bounded(cfg: RunConfig) -> bool:
    """Whether the step peak is a bound, at or above the run's: with experts (its moment can hold
    one expert's rows beside the rest, which the run's router decides; the dry step's loads are
    the hottest, the most any routing gives a rank's experts: ``expert_loads.hottest``), or
    ``timed``."""
    return cfg.model.has_experts or timed(cfg)


def missed(cfg: RunConfig, measured: int, planned: int) -> bool:
    """Whether a run's measured step peak is not the predicted one: equal to the byte, or over
    a bound (``bounded``)."""
    return measured > planned if bounded(cfg) else measured != planned


@functools.lru_cache(maxsize=256)
def stage_step_peak(cfg: RunConfig, stage: int, cp: int = 0, dp: int = 0) -> int:
    """The first rank of pipeline stage ``stage`` at context-parallel coordinate ``cp`` and
    data-parallel ``dp``: the most bytes alive at once in one step."""
    mesh = shape_mesh(cfg.layout, cfg.layout.rank(pp=stage, cp=cp, dp=dp))
    meter = LiveBytes("meta")
    model, chunks, optimizer = _built(cfg, mesh, meter)
    m = cfg.train.grad_accum
    program = PipelineStep(cfg, mesh, model, chunks, "meta") if chunks else LocalStep(model, m, "meta")
    batches = _batches(cfg, mesh, meter)
    counter = routing_count.RoutingCount.for_run(cfg, model, mesh, program, torch.device("meta"))
    with MetaMemo(), cpu_kernels(cfg), meter:  # (the meter sees what the others return)
        counter.count(batches)  # (the step's routing, where counted first; its update after is not run)
        summed = program.run(batches)  # (the loss's accumulator lives to the step's end, as the trainer's)
        # The trainer's batches die when its forward and backward return, before the update (at
        # many micro-batches of one row a context-parallel rank's copies are 3 KB of a step's peak).
        del batches
        for g in optimizer.groups.values():  # ZeroOptimizer.sync_grads short of reading the norm
            g.sync_squares()
            g.use_norm(1.0)
        optimizer.apply_update(1e-3)
        optimizer.zero_grad()
    del summed
    return meter.peak


def _built(cfg: RunConfig, mesh, meter: LiveBytes) -> tuple:
    """The rank's model, its pipeline chunks and its ZeRO optimizer, as ``rank_build.build`` makes
    them, under ``meter``; what the build leaves alive is counted, its temporaries are not a
    step's (nor are they the run's)."""
    with meter:
        # (the experts' hottest loads: the most rows any routing gives them, so a bound with experts)
        model = _on_meta(shape_model(cfg, mesh, expert_loads.HOTTEST))
        chunks, splits = place_model_(model, cfg, mesh)
        # (with overlap at ZeRO-2/3 the thread at its latest: a bound whatever its timing)
        queue = functools.partial(LateFrees, meter=meter) if timed(cfg) else Progress
        optimizer = build_optimizer(cfg, model, mesh, splits, chunk_segments(model, chunks), queue)
    meter.restart()
    return model, chunks, optimizer


def _batches(cfg: RunConfig, mesh, meter: LiveBytes) -> list[tuple]:
    """The step's micro-batches, made at once as the trainer's ``held_batches`` makes them, and
    counted as the run counts them."""
    micro = BatchPlan(cfg.global_batch, cfg.dp_size, cfg.train.grad_accum).micro_batch
    documents = cfg.data.document_mask
    batches = [
        micro_batch(cfg.model.seq_len, micro, mesh, cfg.seed, documents) for _ in range(cfg.train.grad_accum)
    ]
    on_gpu = cfg.device(0) != "cpu"  # (a GPU's tokens are copies of the windows, each its own)
    if on_gpu and mesh.cp is None:
        batches = [(batch[0].clone(), batch[1].clone(), *batch[2:]) for batch in batches]
    for batch in batches:
        held = [t for t in batch[:3] if t is not None]
        if mesh.cp is None and not on_gpu:  # the run's tokens are views of the corpus's windows
            meter.ignore(held)
        else:  # copies: a context-parallel rank's chunks with their positions, or on a GPU
            meter.hold(held)
    return batches


def _on_meta(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s buffers (drawn on the CPU) on the meta device, one tensor shared by several
    modules (the causal mask) still one, as in the run; ``Module.to`` would copy it for each."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            if id(buffer) not in moved:
                moved[id(buffer)] = buffer.to("meta")
            module._buffers[name] = moved[id(buffer)]
    return model
