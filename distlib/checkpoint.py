"""Sharded checkpoints that are verified before they are trusted.

Layout of one checkpoint (``<run_dir>/checkpoints/step_00000010/``)::

    rank00000.safetensors   rank 0's partition of master / exp_avg / exp_avg_sq,
    rank00001.safetensors   its torch RNG state as a uint8 tensor, and (metadata)
    ...                     a JSON "rank_state": step, data position, python/numpy RNG
    manifest.json           written last: world size, step, ZeRO stage, model config,
                            the flat layout (names, shapes, offsets, padding) and, for
                            every file, its relative path, byte size and sha256

Commit protocol: rank 0 creates ``.step_XXXXXXXX.partial/``; every rank writes
and fsyncs its shard and reports (size, sha256) through an all-gather; rank 0
writes ``manifest.json`` (temp name, fsync, rename) and then renames the
directory to its final name. A directory without a committed manifest is never
loaded, and an existing checkpoint is never overwritten.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from distlib import collectives
from distlib.comm import Comm

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, uncommitted or does not fit the model."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


# -- RNG state of this process -------------------------------------------------
def capture_rng() -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, json) holding the torch, numpy and python global RNG states."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    tensors = {"rng.torch": torch.get_rng_state(), "rng.numpy_keys": torch.from_numpy(np_keys.astype(np.int64))}
    meta = {"numpy": [np_kind, int(np_pos), int(np_has_gauss), float(np_gauss)],
            "python": [py_version, list(py_state), py_gauss]}
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    kind, pos, has_gauss, gauss = meta["numpy"]
    np.random.set_state((kind, tensors["rng.numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, state, py_gauss = meta["python"]
    random.setstate((version, tuple(state), py_gauss))


# -- writing -------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _agree(ok: bool, error: str, comm: Comm) -> None:
    """Raise on every rank if any rank failed, so no rank goes on alone."""
    reports = [json.loads(b) for b in collectives.all_gather_bytes(json.dumps([ok, error]).encode(), comm)]
    failed = [(r, msg) for r, (good, msg) in enumerate(reports) if not good]
    if failed:
        raise CheckpointError("; ".join(f"rank {r}: {msg}" for r, msg in failed))


def save(root: Path, step: int, tensors: dict[str, torch.Tensor], rank_state: dict,
         meta: dict, comm: Comm) -> Path:
    """Collectively write this rank's shard; rank 0 commits the manifest. Returns the final path."""
    root = Path(root)
    final = root / step_dir_name(step)
    partial = root / f".{step_dir_name(step)}.partial"
    ok, error = True, ""
    if comm.rank == 0:
        try:
            if final.exists():
                raise CheckpointError(f"refusing to overwrite existing checkpoint {final}")
            root.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left behind by a save that crashed; it was never committed
                shutil.rmtree(partial)
            partial.mkdir()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            ok, error = False, f"{type(exc).__name__}: {exc}"
    _agree(ok, error, comm)

    ok, error, report = True, "", {}
    try:
        blob = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()},
                                      metadata={"rank_state": json.dumps(rank_state)})
        _write_durably(partial / shard_name(comm.rank), blob)
        report = {"path": shard_name(comm.rank), "rank": comm.rank, "bytes": len(blob),
                  "sha256": hashlib.sha256(blob).hexdigest()}
    except Exception as exc:  # noqa: BLE001
        ok, error = False, f"writing {partial / shard_name(comm.rank)}: {type(exc).__name__}: {exc}"
    reports = [json.loads(b) for b in collectives.all_gather_bytes(
        json.dumps({"ok": ok, "error": error, "report": report}).encode(), comm)]
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if not rep["ok"]]
    if failed:
        raise CheckpointError("checkpoint save failed: " + "; ".join(f"rank {r}: {m}" for r, m in failed))

    ok, error = True, ""
    if comm.rank == 0:
        try:
            manifest = {"format_version": FORMAT_VERSION, "step": step, "world_size": comm.size, **meta,
                        "files": [rep["report"] for rep in reports]}
            tmp = partial / (MANIFEST + ".tmp")
            _write_durably(tmp, json.dumps(manifest, indent=2).encode())
            os.replace(tmp, partial / MANIFEST)
            _fsync_dir(partial)
            os.rename(partial, final)
            _fsync_dir(root)
        except Exception as exc:  # noqa: BLE001
            ok, error = False, f"committing {final}: {type(exc).__name__}: {exc}"
    _agree(ok, error, comm)
    return final


# -- reading -------------------------------------------------------------------
def read_manifest(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it was never committed")
    try:
        manifest = json.loads(manifest_path.read_text())
        manifest["files"], manifest["step"], manifest["world_size"]  # noqa: B018 - required keys
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path} does not parse as a checkpoint manifest: {exc}") from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: format_version {manifest.get('format_version')!r}, "
                              f"this program reads {FORMAT_VERSION}")
    return manifest


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path) -> dict:
    """Check every file the manifest lists (size, then sha256) and that nothing else is there.
    Returns the manifest; raises CheckpointError naming the first problem."""
    path = Path(path)
    manifest = read_manifest(path)
    listed = {entry["path"] for entry in manifest["files"]}
    extra = sorted(p.name for p in path.iterdir() if p.name != MANIFEST and p.name not in listed)
    if extra:
        raise CheckpointError(f"checkpoint {path}: unexpected file(s) not in the manifest: {extra}")
    for entry in manifest["files"]:
        file = path / entry["path"]
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: shard {entry['path']} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint {path}: shard {entry['path']} has {size} bytes, "
                                  f"manifest says {entry['bytes']}")
        actual = _sha256_file(file)
        if actual != entry["sha256"]:
            raise CheckpointError(f"checkpoint {path}: shard {entry['path']} sha256 {actual} does not match "
                                  f"manifest {entry['sha256']}")
    return manifest


def load_shard(path: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, rank_state) of one rank's shard. Call ``verify`` first."""
    file = Path(path) / shard_name(rank)
    with safetensors.safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        rank_state = json.loads(f.metadata()["rank_state"])
    return tensors, rank_state


def list_committed(root: Path) -> list[Path]:
    """Committed checkpoint directories under ``root``, oldest step first (not yet verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / MANIFEST).exists()]
    return sorted(found, key=lambda p: p.name)
