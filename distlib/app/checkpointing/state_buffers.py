"""Model state that is not a parameter (``model.balance=bias``'s expert biases) in a checkpoint.

The optimizer state holds the parameters; what training changes besides them is a few small
tensors (``bias_balance.state_buffers``: a name in the whole model -> the live buffer). Each rank
saves its own beside its optimizer partition, as ``buffer.<name>`` in its shard (every rank of a
pipeline stage holds the same values: each is replicated over the stage's ranks), and the manifest
names one file that holds each (``state_buffers``: name -> file rank, the lowest rank holding it).
Loading at any layout reads each of this rank's buffers from that file, by name; an in-memory
rollback point carries them in its tensors the same way. A checkpoint without them (saved with
``model.balance=aux``) leaves the fresh zeros, and rank 0 says so.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distlib.checkpoint import relayout
from distlib.comm import agree
from distlib.comm.group import Comm

KEY = relayout.STATE_BUFFER  # a state buffer's key in a shard


def holders(buffers: dict[str, torch.Tensor], names: list[str], comm: Comm) -> dict[str, int]:
    """name -> the lowest rank holding it, for every one of ``names`` (collective)."""
    held = agree.gather([float(n in buffers) for n in names], comm)
    return {n: min(r for r, row in enumerate(held) if row[i]) for i, n in enumerate(names)}


def captured(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of this rank's buffers, under their shard keys."""
    return {KEY + n: t.detach().to("cpu", copy=True) for n, t in buffers.items()}


def restore(tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    """Set this rank's buffers from ``captured``'s tensors (an in-memory rollback point)."""
    for n, t in buffers.items():
        t.copy_(tensors[KEY + n])


def load(path: Path, manifest: dict, buffers: dict[str, torch.Tensor]) -> bool:
    """Set this rank's buffers from the files of a verified checkpoint of any layout; False (and
    nothing set) when the checkpoint has none."""
    if not buffers or "state_buffers" not in manifest:
        return False
    for n, t in relayout.state_buffers(path, manifest, buffers).items():
        buffers[n].copy_(t)
    return True
