"""The offline tools' reads and writes (scripts/ckpt.py, scripts/export_hf.py): a checkpoint of any
layout made whole, or moved to another world size.

Both go through the one relayout (``checkpoint.relayout``): ``consolidate`` reads the whole model
(every parameter whole, in the model's order) on one place; ``reshard_checkpoint`` writes a
data-parallel checkpoint for N ranks, partition r of the whole model's flat layout each, from a
checkpoint of any dp, cp, tp or pp degree. A run of any layout resumes from either, at the exact
data position: the position does not depend on the layout as long as the global batch is the same
(``distlib.app.data``).

RNG: rank r of a resharded checkpoint takes old rank r's RNG state when the old checkpoint was
data-parallel only and had a rank r; other ranks have none (the trainer re-seeds them and says so).
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch

from distlib.checkpoint import extra_files, relayout
from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.relayout import Place
from distlib.checkpoint.sharded import CheckpointError
from distlib.comm.layout import Layout
from distlib.parallel.flat_layout import FlatLayout


def full_state(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """Each of STATE_KEYS as one unpadded flat vector of every parameter, whole, in the model's order
    (``relayout.whole_layout``), from a verified checkpoint of any layout."""
    layout = relayout.whole_layout(manifest)
    return {k: v[: layout.numel] for k, v in relayout.read_partition(path, manifest, Place(layout)).items()}


def _by_parameter(flat: torch.Tensor, layout: FlatLayout, prefix: str = "") -> dict[str, torch.Tensor]:
    return {
        prefix + s.name: flat[s.offset : s.offset + s.numel].reshape(s.shape).clone() for s in layout.slots
    }


def check_new_output(out: Path | str) -> None:
    """The offline tools write only somewhere new: never over an existing path, and never inside a
    checkpoint directory, whose verification refuses every file its manifest does not list --
    writing there would turn a sound checkpoint into a damaged one."""
    if Path(out).exists() or Path(out).is_symlink():
        raise CheckpointError(f"refusing to overwrite existing {out}: give a path that does not exist yet")
    for parent in Path(out).resolve().parents:
        if (parent / checkpoint.MANIFEST).is_file():
            raise CheckpointError(
                f"refusing to write {out} inside checkpoint {parent}: a file its manifest "
                f"does not list would fail its verification; write it elsewhere"
            )


def consolidate(path: Path, out: Path, with_optimizer: bool = False) -> list[Path]:
    """Write ``out/model.safetensors`` (full fp32 weights named as in ``MiniGPT.state_dict()``, and
    the model state besides them: the expert biases of ``model.balance=bias``, by name), if
    asked ``out/optimizer.safetensors`` (exp_avg.NAME / exp_avg_sq.NAME), and the checkpoint's extra
    files at their own paths (``out/tokenizer/...``: what the weights need to be used). Verifies first."""
    path, out = Path(path), Path(out)
    manifest = checkpoint.verify(path)
    names = {"model.safetensors", "optimizer.safetensors"}
    clash = sorted(e["path"] for e in extra_files.listed(manifest) if e["path"].split("/")[0] in names)
    if clash:
        raise CheckpointError(f"consolidating {path}: its extra file {clash[0]} would overwrite the weights")
    layout = relayout.whole_layout(manifest)
    state = full_state(path, manifest)
    header = {"step": str(manifest["step"]), "model": json.dumps(manifest["model"]), "source": str(path)}
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "model.safetensors"]
    weights = _by_parameter(state["master"], layout) | relayout.state_buffers(path, manifest)  # (and biases)
    safetensors.torch.save_file(weights, str(written[0]), metadata=header)
    if with_optimizer:
        tensors = {
            **_by_parameter(state["exp_avg"], layout, "exp_avg."),
            **_by_parameter(state["exp_avg_sq"], layout, "exp_avg_sq."),
        }
        optimizer_steps = relayout.rank_state(path, manifest, Place(layout))[0]["optimizer_steps"]
        written.append(out / "optimizer.safetensors")
        safetensors.torch.save_file(
            tensors, str(written[1]), metadata={**header, "optimizer_steps": str(optimizer_steps)}
        )
    return written + _copy_extras(path, manifest, out)


def _copy_extras(path: Path, manifest: dict, out: Path) -> list[Path]:
    try:
        return extra_files.copy_listed(path, manifest, out)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: copying its extra files: {exc}") from exc


def reshard_checkpoint(path: Path, out: Path, world_size: int) -> Path:
    """Write a new committed data-parallel checkpoint at ``out`` for ``world_size`` ranks from
    ``path`` of any layout (verified first), with the same extra files."""
    path, out = Path(path), Path(out)
    if world_size < 1:
        raise CheckpointError(f"--world-size must be >= 1, got {world_size}")
    manifest = checkpoint.verify(path)
    layout = relayout.whole_layout(manifest, world_size)
    checkpoint.begin(out)
    partial = checkpoint.partial_dir(out)
    files = []
    # the model state besides the parameters: replicated, so in the first file (and named there)
    buffers = {relayout.STATE_BUFFER + n: t for n, t in relayout.state_buffers(path, manifest).items()}
    for rank in range(world_size):
        place = Place(layout, rank, world_size)
        tensors = relayout.read_partition(path, manifest, place)
        rank_state, rng = relayout.rank_state(path, manifest, place)
        kept = buffers if rank == 0 else {}
        files.append(checkpoint.write_shard(partial, rank, {**tensors, **(rng or {}), **kept}, rank_state))
    _copy_extras(path, manifest, partial)  # the same bytes: the entries carry over as they are
    new = {k: v for k, v in manifest.items() if k not in ("tp_layouts", "pp_layouts", "pp", "group_holdings")}
    new.update(
        world_size=world_size,
        tp=1,
        dp=world_size,
        parallel=Layout.of(world_size).to_dict(),
        layout=layout.to_dict(),
        files=files,
        resharded_from={"path": str(path), "world_size": int(manifest["world_size"])},
    )
    if "state_buffers" in manifest:
        new["state_buffers"] = {n: 0 for n in manifest["state_buffers"]}
    checkpoint.commit(partial, out, new)
    return out
