"""Loading a checkpoint at another tensor-parallel degree than it was saved with.

A tensor-parallel checkpoint stores each rank's pieces of the split parameters, and its manifest
says how each was cut (``tp_layouts``: dim, parts, index, groups). Another degree needs other
pieces, which no single file holds: so each of the optimizer's fp32 vectors (master weights and
both Adam moments) is reassembled whole by name (``assemble.full_tensors``, which also joins
pipeline stages and data-parallel partitions), each parameter cut to this rank's new split
(``tensor_parallel.shard_of``) and laid out in this rank's flat layout, of which the rank keeps
its ZeRO partition. The arithmetic is copies only, so the loaded state is the saved state
exactly. Every rank reads every file, a whole model per state vector: the price of a change of
degree, paid once at a resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from distlib.checkpoint import assemble
from distlib.checkpoint.reshard import open_shard
from distlib.checkpoint.sharded import CheckpointError
from distlib.parallel.adamw import STATE_KEYS
from distlib.parallel.flat_layout import FlatLayout
from distlib.parallel.tensor_parallel import Split, shard_of


def load_resplit(
    path: Path, manifest: dict, rank: int, world_size: int, layout: FlatLayout, splits: dict[str, Split]
) -> tuple[dict[str, torch.Tensor], dict, None]:
    """(state, rank_state, None) for partition ``rank`` of ``world_size`` of ``layout`` (this rank's
    flat layout, its split parameters cut as ``splits`` says) from a verified checkpoint at any
    tensor-parallel degree. No RNG state carries over (the ranks are other ranks)."""
    path = Path(path)
    size = -(-layout.numel // world_size)
    lo = rank * size
    state = {}
    for key in STATE_KEYS:
        full = assemble.full_tensors(path, manifest, key)
        flat = torch.zeros(size * world_size, dtype=torch.float32)
        for slot in layout.slots:
            if slot.name not in full:
                raise CheckpointError(f"checkpoint {path} has no parameter {slot.name}")
            piece = shard_of(full[slot.name], splits.get(slot.name))
            if tuple(piece.shape) != slot.shape:
                raise CheckpointError(
                    f"checkpoint {path}: parameter {slot.name} cut for this rank has shape "
                    f"{tuple(piece.shape)}, the model's is {slot.shape}"
                )
            flat[slot.offset : slot.offset + slot.numel] = piece.reshape(-1)
        state[key] = flat[lo : lo + size].clone()
    with open_shard(path, 0) as f:
        rank_state = json.loads(f.metadata()["rank_state"])
    rank_state["rng"] = None
    return state, rank_state, None
