"""The whole model's tensors from a checkpoint of any layout, by parameter name.

A checkpoint holds, per pipeline stage and tensor-parallel rank, one flat layout (manifest
``layout``; ``tp_layouts`` per tensor rank; ``pp_layouts[stage][tp_rank]`` per stage), each
partitioned over the data-parallel ranks, whose files are in the layout's rank order
(distlib/comm/layout.py). ``full_tensors`` concatenates each layout's data-parallel partitions (the
padding dropped), cuts the flat vector into its named parameters, joins the tensor-parallel pieces
of each split parameter (``tensor_parallel.unshard``, the inverse of ``shard_of``) and takes a
replicated one from tensor rank 0 (every tensor rank holds the same bytes of it). The stages hold
disjoint parameters, so together they are the whole model, in its own parameter order.

Sampling and the Hugging Face export read a checkpoint this way; call ``sharded.verify`` first.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distlib.checkpoint import sharded
from distlib.checkpoint.sharded import CheckpointError
from distlib.comm.layout import Layout
from distlib.parallel.adamw import STATE_KEYS
from distlib.parallel.flat_layout import FlatLayout
from distlib.parallel.tensor_parallel import unshard


def stage_layouts(manifest: dict) -> list[list[dict]]:
    """[stage][tp_rank] -> that shard group's flat layout dict (one stage without pipelining)."""
    return manifest.get("pp_layouts") or [manifest.get("tp_layouts") or [manifest["layout"]]]


def full_tensors(path: Path, manifest: dict, key: str = "master") -> dict[str, torch.Tensor]:
    """Every parameter of the whole (unsplit) model, fp32, named as the model names it, from the
    ``key`` vector (one of STATE_KEYS: the weights, or an Adam moment) of a verified checkpoint."""
    if key not in STATE_KEYS:
        raise ValueError(f"key must be one of {STATE_KEYS}, got {key!r}")
    path = Path(path)
    grid = Layout.of_manifest(manifest).partitions()  # the flat layouts' partitions: dp x cp
    pieces: dict[str, list[tuple[dict | None, torch.Tensor]]] = {}
    for s, per_tp in enumerate(stage_layouts(manifest)):
        for t, layout_dict in enumerate(per_tp):
            layout = FlatLayout.from_dict(layout_dict)
            files = grid.group(grid.rank(pp=s, tp=t), ("dp",))
            flat = torch.cat([sharded.load_shard(path, r)[0][key] for r in files])[: layout.numel]
            for p, slot in zip(layout_dict["params"], layout.slots):
                local = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
                pieces.setdefault(slot.name, []).append((p.get("split"), local))
    out = {}
    for name, held in pieces.items():
        split = held[0][0]
        if split is None:
            out[name] = held[0][1].clone()
            continue
        by_index = sorted(held, key=lambda h: h[0]["index"])
        if [h[0]["index"] for h in by_index] != list(range(split["parts"])):
            raise CheckpointError(
                f"checkpoint {path}: parameter {name} has tensor-parallel pieces "
                f"{[h[0]['index'] for h in by_index]}, expected 0..{split['parts'] - 1}"
            )
        out[name] = unshard([h[1] for h in by_index], split["dim"], split["groups"])
    return out
