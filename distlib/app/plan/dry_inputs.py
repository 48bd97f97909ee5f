"""What the planner's dry steps run with: the micro-batch the trainer would hand a rank, on the
meta device (``micro_batch``), and, for a low precision on the CPU, the CPU's kernels where what
they keep differs from the meta device's (``cpu_results``; as a mode, ``cpu_kernels``). Used by
``activations`` (the units) and ``step_peak`` (the whole step)."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distlib.app.config.run import RunConfig
from distlib.app.data.batches import held_tokens
from distlib.parallel.documents import Documents
from distlib.parallel.dropout import Draws


def cpu_results(func, args: tuple, out):
    """The results ``out`` of ``func`` on the meta device as torch's CPU kernel returns them where
    what they keep differs from the meta device's (CUDA's): layer_norm keeps its mean and rstd in a
    bf16 input's dtype, not float32 (measured: 10 of minigpt's 44 saved tensors, 1,280 of 175,012
    bytes at 4 x 16 tokens)."""
    if func is torch.ops.aten.native_layer_norm.default and args[0].dtype != torch.float32:
        return out[0], out[1].to(args[0].dtype), out[2].to(args[0].dtype)
    return out


class _CpuKernels(TorchDispatchMode):
    """The meta device's kernels answering as the CPU's (``cpu_results``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return cpu_results(func, args, func(*args, **(kwargs or {})))


def cpu_kernels(cfg: RunConfig):
    """``_CpuKernels`` where ``cfg`` runs on the CPU in a low precision, else nothing."""
    return _CpuKernels() if low_precision_on_cpu(cfg) else contextlib.nullcontext()


def low_precision_on_cpu(cfg: RunConfig) -> bool:
    return cfg.device(0) == "cpu" and cfg.param_dtype != torch.float32


def micro_batch(seq_len: int, micro: int, mesh, seed: int, documents: bool = False) -> tuple:
    """(inputs, targets, positions, draws, documents) as the trainer hands one micro-batch over.
    Its inputs and targets are views of one (micro, seq + 1) array of windows, which the meters
    count whole, unless the context-parallel rank's chunks are copied out of it. The documents'
    starts (with masks) are shapes only: at cp = 1 what a forward keeps does not depend on them."""
    on = "cpu" if mesh.cp is not None else "meta"
    windows = torch.zeros((micro, seq_len + 1), dtype=torch.long, device=on)
    inputs, targets, positions = held_tokens(windows[:, :-1], windows[:, 1:], mesh.cp, "meta")
    draws = Draws(seed, (), share=(mesh.tp.rank, mesh.tp.size)).of(range(micro))
    starts = Documents(torch.zeros((micro, seq_len), dtype=torch.int64, device="meta")) if documents else None
    return inputs, targets, positions, draws, starts
