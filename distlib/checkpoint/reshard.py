"""Moving a checkpoint to another world size, or out of the sharded format altogether.

A checkpoint holds three flat fp32 vectors (master weights, Adam exp_avg and
exp_avg_sq) over all P parameters in ``FlatLayout`` order. With N ranks each
vector is zero-padded to N*S elements, S = ceil(P/N), and rank r stores
elements [r*S, (r+1)*S). The ZeRO stage does not change this, so resharding is
one rule for every stage: concatenate the N partitions, keep the first P
elements (drop the padding), pad for M ranks and split into M partitions
(``repartition``). ``partition_sources`` is the same rule as index arithmetic,
so a rank of the new world reads only the slices of the old shards it needs.
A tensor-parallel checkpoint has one flat layout per tensor-parallel rank
(manifest ``tp_layouts``); ``load_partition`` reshards each across data-parallel
ranks with these same functions (same ``tp``); consolidating one or changing its
``tp`` is not supported.

A pipeline-parallel checkpoint (manifest ``pp`` = P) holds one flat layout per stage and tensor
rank (``pp_layouts``), its files in the layout's rank order (distlib/comm/layout.py).
Loading it at another pipeline degree, or a pp = 1 one into stages, goes by parameter name
(``_load_by_name``): each element of the new partition is found in the stage that held its
parameter and read from that stage's data-parallel shards -- the same index arithmetic, per
parameter.

RNG: new rank r takes old rank r's RNG state when r < N; ranks r >= N have none
(the caller re-seeds them and says so). The data position is world-size
independent as long as the global batch stays the same (``distlib.data``).
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from distlib.checkpoint import extra_files
from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.sharded import CheckpointError
from distlib.comm.layout import Layout
from distlib.parallel.adamw import STATE_KEYS
from distlib.parallel.flat_layout import FlatLayout


# -- the rule, as pure functions ---------------------------------------------
def shard_numel(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


def repartition(partitions: list[torch.Tensor], numel: int, world_size: int) -> list[torch.Tensor]:
    """Re-split a flat vector stored as len(partitions) padded partitions into ``world_size`` ones."""
    full = torch.cat([p.reshape(-1) for p in partitions])
    if full.numel() < numel:
        raise CheckpointError(f"partitions hold {full.numel()} elements, fewer than the {numel} parameters")
    size = shard_numel(numel, world_size)
    padded = torch.zeros(size * world_size, dtype=full.dtype, device=full.device)
    padded[:numel] = full[:numel]
    return [padded[r * size : (r + 1) * size].clone() for r in range(world_size)]


def partition_sources(
    numel: int, old_world: int, new_world: int, new_rank: int
) -> list[tuple[int, int, int]]:
    """The pieces (old_rank, start, end) of old partitions that, concatenated, form the real
    (unpadded) elements of partition ``new_rank`` of ``new_world``; the rest of it is padding."""
    old_size, new_size = shard_numel(numel, old_world), shard_numel(numel, new_world)
    lo, hi = new_rank * new_size, min((new_rank + 1) * new_size, numel)
    pieces = []
    for old_rank in range(old_world):
        a, b = max(lo, old_rank * old_size), min(hi, (old_rank + 1) * old_size)
        if a < b:
            pieces.append((old_rank, a - old_rank * old_size, b - old_rank * old_size))
    return pieces


# -- reading a checkpoint into another world ---------------------------------
def open_shard(path: Path, rank: int):
    try:
        return safetensors.safe_open(str(path / checkpoint.shard_name(rank)), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"checkpoint {path}: cannot read {checkpoint.shard_name(rank)}: {exc}") from exc


def _tensor_parallel(manifest: dict) -> int:
    return int(manifest.get("tp", 1))


def _whole_model_only(manifest: dict, what: str) -> None:
    if int(manifest.get("pp", 1)) > 1:
        raise CheckpointError(
            f"{what}: this checkpoint is pipeline-parallel (pp={manifest['pp']}); each stage's "
            f"shards hold other parameters (manifest pp_layouts) and are not supported here"
        )
    if _tensor_parallel(manifest) > 1:
        raise CheckpointError(
            f"{what}: this checkpoint is tensor-parallel (tp={manifest['tp']}); its shards "
            f"hold pieces of tensors (manifest tp_layouts) and are not supported here"
        )


def load_partition(
    path: Path,
    manifest: dict,
    rank: int,
    world_size: int,
    tp_rank: int = 0,
    stage: tuple[FlatLayout, int, int] | None = None,
) -> tuple[dict[str, torch.Tensor], dict, dict[str, torch.Tensor] | None]:
    """(state, rank_state, rng) for ``rank`` of ``world_size`` from a verified checkpoint of any
    world size: state is partition ``rank`` of each of STATE_KEYS; rng is the saved RNG tensors
    (None when the checkpoint has no rank ``rank`` or that rank kept none). For a tensor-parallel
    checkpoint (manifest ``tp`` = T), ``rank``/``world_size`` are data-parallel and the state
    comes from tensor rank ``tp_rank``'s shards (the checkpoint's layout gives their files). ``stage``:
    (this rank's flat layout, its pipeline rank, the pipeline degree) when the run is
    pipeline-parallel; then, or when the checkpoint is, parameters are found by name."""
    path = Path(path)
    if int(manifest.get("pp", 1)) > 1 or (stage is not None and stage[2] > 1):
        return _load_by_name(path, manifest, rank, world_size, tp_rank, stage)
    tp, grid = _tensor_parallel(manifest), Layout.of_manifest(manifest).partitions()
    layout = manifest["tp_layouts"][tp_rank] if tp > 1 else manifest["layout"]
    numel, old_world = int(layout["numel"]), grid.dp
    file_rank = lambda d: grid.rank(dp=d, tp=tp_rank)  # noqa: E731
    size = shard_numel(numel, world_size)
    state = {key: torch.zeros(size, dtype=torch.float32, device="cpu") for key in STATE_KEYS}  # host copies
    filled = 0
    for old_rank, start, end in partition_sources(numel, old_world, world_size, rank):
        with open_shard(path, file_rank(old_rank)) as f:
            for key in STATE_KEYS:
                state[key][filled : filled + end - start] = f.get_slice(key)[start:end]
        filled += end - start
    own = rank if rank < old_world else 0
    with open_shard(path, file_rank(own)) as f:
        rank_state = json.loads(f.metadata()["rank_state"])
        rng = {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng.")}
    if rank != own or not rng or rank_state.get("rng") is None:
        rank_state["rng"], rng = None, None
    return state, rank_state, rng


def _load_by_name(
    path: Path,
    manifest: dict,
    rank: int,
    world_size: int,
    tp_rank: int,
    stage: tuple[FlatLayout, int, int] | None,
):
    if stage is None:
        raise CheckpointError(f"checkpoint {path} is pipeline-parallel: loading it needs this rank's layout")
    layout, pp_rank, pp = stage
    grid = Layout.of_manifest(manifest).partitions()
    old_pp, old_dp = grid.pp, grid.dp
    stages = manifest.get("pp_layouts") or [manifest.get("tp_layouts") or [manifest["layout"]]]
    where = {}  # parameter name -> (old stage, offset in its flat layout, that layout's numel)
    for s, per_tp in enumerate(stages):
        old = FlatLayout.from_dict(per_tp[tp_rank])
        where.update({slot.name: (s, slot.offset, old.numel) for slot in old.slots})
    size = shard_numel(layout.numel, world_size)
    lo, hi = rank * size, min((rank + 1) * size, layout.numel)
    state = {key: torch.zeros(size, dtype=torch.float32, device="cpu") for key in STATE_KEYS}  # host copies
    for slot in layout.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a >= b:
            continue
        if slot.name not in where:
            raise CheckpointError(f"checkpoint {path} has no parameter {slot.name}")
        s, offset, numel = where[slot.name]
        src = offset + a - slot.offset  # [src, src + b - a) of stage s's flat vector
        for old_rank, start, end in _pieces(numel, old_dp, src, src + b - a):
            with open_shard(path, grid.rank(pp=s, dp=old_rank, tp=tp_rank)) as f:
                at = a - lo + old_rank * shard_numel(numel, old_dp) + start - src
                for key in STATE_KEYS:
                    state[key][at : at + end - start] = f.get_slice(key)[start:end]
    same = old_pp == pp and rank < old_dp  # the same place existed: its RNG carries over
    own = grid.rank(pp=pp_rank, dp=rank, tp=tp_rank) if same else grid.rank(tp=tp_rank)
    with open_shard(path, own) as f:
        rank_state = json.loads(f.metadata()["rank_state"])
        rng = {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng.")}
    if not same or not rng or rank_state.get("rng") is None:
        rank_state["rng"], rng = None, None
    return state, rank_state, rng


def _pieces(numel: int, old_world: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(old_rank, start, end) within old partitions that hold elements [lo, hi) of a flat vector."""
    size = shard_numel(numel, old_world)
    return [
        (r, max(lo, r * size) - r * size, min(hi, (r + 1) * size) - r * size)
        for r in range(old_world)
        if max(lo, r * size) < min(hi, (r + 1) * size)
    ]


def _shards(path: Path, manifest: dict) -> list[dict[str, torch.Tensor]]:
    return [checkpoint.load_shard(path, r)[0] for r in range(int(manifest["world_size"]))]


def full_state(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """Each of STATE_KEYS as one unpadded flat vector of all P parameters."""
    _whole_model_only(manifest, f"reading the whole model from {path}")
    numel, shards = int(manifest["layout"]["numel"]), _shards(path, manifest)
    return {key: torch.cat([s[key] for s in shards])[:numel] for key in STATE_KEYS}


def _by_parameter(flat: torch.Tensor, layout: FlatLayout, prefix: str = "") -> dict[str, torch.Tensor]:
    return {
        prefix + s.name: flat[s.offset : s.offset + s.numel].reshape(s.shape).clone() for s in layout.slots
    }


# -- offline tools (scripts/ckpt.py, scripts/export_hf.py) ---------------------------
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
    """Write ``out/model.safetensors`` (full fp32 weights named as in ``MiniGPT.state_dict()``), if
    asked ``out/optimizer.safetensors`` (exp_avg.NAME / exp_avg_sq.NAME), and the checkpoint's extra
    files at their own paths (``out/tokenizer/...``: what the weights need to be used). Verifies first."""
    path, out = Path(path), Path(out)
    manifest = checkpoint.verify(path)
    names = {"model.safetensors", "optimizer.safetensors"}
    clash = sorted(e["path"] for e in extra_files.listed(manifest) if e["path"].split("/")[0] in names)
    if clash:
        raise CheckpointError(f"consolidating {path}: its extra file {clash[0]} would overwrite the weights")
    layout = FlatLayout.from_dict(manifest["layout"])
    state = full_state(path, manifest)
    header = {"step": str(manifest["step"]), "model": json.dumps(manifest["model"]), "source": str(path)}
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "model.safetensors"]
    safetensors.torch.save_file(_by_parameter(state["master"], layout), str(written[0]), metadata=header)
    if with_optimizer:
        tensors = {
            **_by_parameter(state["exp_avg"], layout, "exp_avg."),
            **_by_parameter(state["exp_avg_sq"], layout, "exp_avg_sq."),
        }
        optimizer_steps = checkpoint.load_shard(path, 0)[1]["optimizer_steps"]
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
    """Write a new committed checkpoint at ``out`` for ``world_size`` ranks (verifies ``path`` first),
    with the same extra files. Ranks beyond the old world size carry no RNG state; the trainer
    re-seeds them on load."""
    path, out = Path(path), Path(out)
    if world_size < 1:
        raise CheckpointError(f"--world-size must be >= 1, got {world_size}")
    manifest = checkpoint.verify(path)
    _whole_model_only(manifest, f"resharding {path}")
    old_world = int(manifest["world_size"])
    layout = FlatLayout.from_dict(manifest["layout"])
    numel, shards = layout.numel, _shards(path, manifest)
    partitions = {key: repartition([s[key] for s in shards], numel, world_size) for key in STATE_KEYS}
    checkpoint.begin(out)
    partial = checkpoint.partial_dir(out)
    files = []
    for rank in range(world_size):
        own = rank if rank < old_world else 0
        tensors, rank_state = checkpoint.load_shard(path, own)
        if rank != own:
            tensors = {k: v for k, v in tensors.items() if not k.startswith("rng.")}
            rank_state["rng"] = None
        tensors.update({key: partitions[key][rank] for key in STATE_KEYS})
        files.append(checkpoint.write_shard(partial, rank, tensors, rank_state))
    _copy_extras(path, manifest, partial)  # the same bytes: the entries carry over as they are
    new = {
        **manifest,
        "world_size": world_size,
        "dp": world_size,  # tp == 1 (_whole_model_only)
        "parallel": Layout.of(world_size).to_dict(),
        "layout": FlatLayout(layout.slots, world_size).to_dict(),
        "files": files,
        "resharded_from": {"path": str(path), "world_size": old_world},
    }
    checkpoint.commit(partial, out, new)
    return out
