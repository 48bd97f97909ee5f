"""The bytes a rank's forward keeps for its backward, predicted by running that forward on the
meta device: the memory table's "activations" figure (``observe.activations.ActivationMeter``).

The planner builds the rank's model as ``states`` does, casts its parameters to the compute dtype as
the optimizer does, and runs one micro-batch through it under the same meter, on the meta device
(shapes only, no arithmetic) and over the mesh's dry groups (``Comm.dry``: a tensor-parallel
all-reduce, a sequence-parallel gather, a context-parallel all-to-all or ring message moves nothing
and returns what a real one's shape is), with the batch the trainer would hand it: the micro-batch's
rows, the context-parallel rank's chunks and positions (``data.batches.held_tokens``), the dropout
keys. The ranks of a layout hold the same shapes (at pp = 1), so one forward serves them all.

Not predicted (None) yet: models with experts (where the tokens go, and so what each expert keeps,
depends on the routing), pipeline stages (their in-flight micro-batches), and document masking.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distlib.app.config.groups import TrainConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.operation import DistConfig
from distlib.app.config.run import DTYPES, RunConfig
from distlib.app.data.batches import BatchPlan, held_tokens
from distlib.app.model.placement import place_model_, shape_model
from distlib.app.observe.activations import ActivationMeter
from distlib.comm.mesh import shape_mesh
from distlib.parallel.dropout import Draws


def rank_activations(cfg: RunConfig) -> list[int | None]:
    """``kept_bytes`` per rank of the layout, in rank order."""
    return [kept_bytes(cfg)] * cfg.dist.world_size


def kept_bytes(cfg: RunConfig) -> int | None:
    """What each rank's forward keeps for its backward (the largest micro-batch's), or None where
    the planner cannot say yet (the module's docstring)."""
    if cfg.model.has_experts or cfg.dist.pp > 1 or cfg.data.document_mask:
        return None
    micro = BatchPlan(cfg.global_batch, cfg.dp_size, cfg.train.grad_accum).micro_batch
    cpu = cfg.device(0) == "cpu"
    return _kept(cfg.model, cfg.dist, cfg.train.dtype, micro, cfg.seed, cpu)


class _CpuKernels(TorchDispatchMode):
    """torch's CPU kernels where what they keep differs from the meta device's (CUDA's) kernels:
    layer_norm keeps its mean and rstd in a bf16 input's dtype, not float32 (measured: 10 of
    minigpt's 44 saved tensors, 1,280 of 175,012 bytes at 4 x 16 tokens)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.native_layer_norm.default and args[0].dtype != torch.float32:
            return out[0], out[1].to(args[0].dtype), out[2].to(args[0].dtype)
        return out


@functools.lru_cache(maxsize=1024)
def _kept(model: ModelConfig, dist: DistConfig, dtype: str, micro: int, seed: int, cpu: bool) -> int:
    cfg = RunConfig(model=model, dist=dist, train=TrainConfig(dtype=dtype))
    mesh = shape_mesh(cfg.layout, 0)
    module = shape_model(cfg, mesh).to("meta")  # (buffers drawn on the CPU move too)
    place_model_(module, cfg, mesh)
    for p in module.parameters():  # the optimizer's flat buffer holds them in the compute dtype
        p.data = torch.empty(p.shape, dtype=DTYPES[dtype], device="meta")
    # The trainer's inputs and targets are views of one (micro, seq + 1) array of windows, which the
    # meter counts whole, unless the context-parallel rank's chunks are copied out of it.
    on = "cpu" if mesh.cp is not None else "meta"
    windows = torch.zeros((micro, model.seq_len + 1), dtype=torch.long, device=on)
    inputs, targets, positions = held_tokens(windows[:, :-1], windows[:, 1:], mesh.cp, "meta")
    draws = Draws(seed, (), share=(mesh.tp.rank, mesh.tp.size)).of(range(micro))
    meter = ActivationMeter()
    module.train()
    with meter.measure(module), _CpuKernels() if cpu else contextlib.nullcontext():
        module(inputs, targets, positions, draws, None)
    return meter.peak
