"""The bytes a rank's step keeps for its backward, predicted by running the trainer's own step
program on the meta device: the memory table's "activations" figure (the ``ActivationMeter`` of
``LocalStep``, or at pp > 1 the pipeline ``Recorder``'s peak over the in-flight micro-batches).

The planner builds the rank's model as ``states`` does, gives its parameters the compute dtype as
the optimizer does, and runs one step of ``LocalStep`` or ``PipelineStep`` (the stage's chunks and
schedule) on the meta device (shapes only, no arithmetic) over the mesh's dry groups (``Comm.dry``:
a tensor-parallel all-reduce, a sequence-parallel gather, a context-parallel all-to-all or ring
message, a pipeline send moves nothing and a receive has a real one's shape), with the batches the
trainer would hand it: the micro-batch's rows, the context-parallel rank's chunks and positions
(``data.batches.held_tokens``), the dropout keys. The ranks of one pipeline stage hold the same
shapes, so one step per stage serves them all.

Not predicted (None) yet: models with experts (where the tokens go, and so what each expert keeps,
depends on the routing) and document masking.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distlib.app.config.groups import TrainConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.operation import DistConfig
from distlib.app.config.run import RunConfig
from distlib.app.data.batches import BatchPlan, held_tokens
from distlib.app.model.local_step import LocalStep
from distlib.app.model.pipeline_step import PipelineStep
from distlib.app.model.placement import place_model_, shape_model
from distlib.app.plan.timing import Counted, OpCounter
from distlib.comm import tally
from distlib.comm.mesh import shape_mesh
from distlib.parallel.dropout import Draws


def rank_activations(cfg: RunConfig) -> list[int | None]:
    """What each rank's step keeps for its backward, in rank order (None: not predicted, the
    module's docstring). The ranks of one pipeline stage hold the same shapes."""
    if cfg.model.has_experts or cfg.data.document_mask:
        return [None] * cfg.dist.world_size
    stages = [_dry_step(*_key(cfg), s)[0] for s in range(cfg.dist.pp)]
    layout = cfg.layout
    return [stages[layout.coords(rank)["pp"]] for rank in range(layout.world_size)]


class _CpuKernels(TorchDispatchMode):
    """torch's CPU kernels where what they keep differs from the meta device's (CUDA's) kernels:
    layer_norm keeps its mean and rstd in a bf16 input's dtype, not float32 (measured: 10 of
    minigpt's 44 saved tensors, 1,280 of 175,012 bytes at 4 x 16 tokens)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.native_layer_norm.default and args[0].dtype != torch.float32:
            return out[0], out[1].to(args[0].dtype), out[2].to(args[0].dtype)
        return out


def stage_counts(cfg: RunConfig) -> list[Counted] | None:
    """Per pipeline stage, what its first rank's step computes and sends (``timing.Counted``),
    from the same dry step; None where the activations are not predicted."""
    if cfg.model.has_experts or cfg.data.document_mask:
        return None
    return [_dry_step(*_key(cfg), s)[1] for s in range(cfg.dist.pp)]


def _key(cfg: RunConfig) -> tuple:
    micro = BatchPlan(cfg.global_batch, cfg.dp_size, cfg.train.grad_accum).micro_batch
    train = TrainConfig(dtype=cfg.train.dtype, grad_accum=cfg.train.grad_accum)
    cpu = cfg.device(0) == "cpu" and cfg.param_dtype != torch.float32  # (the kernels differ in bf16)
    return cfg.model, cfg.dist, train, micro, cfg.seed, cpu


@functools.lru_cache(maxsize=1024)
def _dry_step(
    model: ModelConfig, dist: DistConfig, train: TrainConfig, micro: int, seed: int, cpu: bool, stage: int
) -> tuple[int, Counted]:
    """One step of the trainer's own program (``LocalStep``, or ``PipelineStep`` over the stage's
    chunks and schedule) on the first rank of pipeline stage ``stage``, on the meta device: its
    activation peak, as the run measures it, and what it computed and sent."""
    cfg = RunConfig(model=model, dist=dist, train=train)
    mesh = shape_mesh(cfg.layout, cfg.layout.rank(pp=stage))
    module = shape_model(cfg, mesh).to("meta")  # (buffers drawn on the CPU move too)
    chunks, _ = place_model_(module, cfg, mesh)
    for p in module.parameters():  # the optimizer's flat buffer holds them in the compute dtype
        p.data = torch.empty(p.shape, dtype=cfg.param_dtype, device="meta")
    batch = _micro_batch(model.seq_len, micro, mesh, seed)
    program = (
        PipelineStep(cfg, mesh, module, chunks, "meta")
        if chunks
        else LocalStep(module, train.grad_accum, "meta")
    )
    ops = OpCounter()
    with _CpuKernels() if cpu else contextlib.nullcontext(), tally.tallied() as calls, ops:
        program.run([batch] * train.grad_accum)
    return program.activation_peak, Counted(ops.flops, ops.ops, ops.written, tuple(calls))


def _micro_batch(seq_len: int, micro: int, mesh, seed: int) -> tuple:
    """(inputs, targets, positions, draws, documents) as the trainer hands one micro-batch over.
    Its inputs and targets are views of one (micro, seq + 1) array of windows, which the meters
    count whole, unless the context-parallel rank's chunks are copied out of it."""
    on = "cpu" if mesh.cp is not None else "meta"
    windows = torch.zeros((micro, seq_len + 1), dtype=torch.long, device=on)
    inputs, targets, positions = held_tokens(windows[:, :-1], windows[:, 1:], mesh.cp, "meta")
    draws = Draws(seed, (), share=(mesh.tp.rank, mesh.tp.size)).of(range(micro))
    return inputs, targets, positions, draws, None
