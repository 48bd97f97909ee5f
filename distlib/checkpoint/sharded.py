"""Sharded checkpoints that are verified before they are trusted.

Layout of one checkpoint (``<run_dir>/checkpoints/step_00000010/``)::

    rank00000.safetensors   rank 0's partition of master / exp_avg / exp_avg_sq,
    rank00001.safetensors   its torch RNG state as a uint8 tensor, and (metadata)
    ...                     a JSON "rank_state": step, data position, python/numpy RNG
    tokenizer/...           run-level extra files, when the run has any (a BPE run's tokenizer)
    manifest.json           written last: world size, step, ZeRO stage, model config,
                            data position, the flat layout (names, shapes, offsets,
                            padding) and, for every file, its name, byte size and sha256

Commit protocol: rank 0 creates ``.step_XXXXXXXX.partial/`` (``open_save``); every rank writes
and fsyncs its shard (``write_own_shard``: inline, or in a background thread for an async save)
and reports (size, sha256) through an all-gather (``complete_save``); rank 0 copies in the
run-level extra files (``extra_files``), writes ``manifest.json`` (temp name, fsync, rename) and
then renames the directory to its final name. A crash at any point leaves either no
``step_XXXXXXXX`` directory or a complete one; a directory without a committed manifest is never
loaded, the next save of its step removes a stale ``.partial`` (and the trainer's run end any
left), and an existing checkpoint is never overwritten. A failed write (a full disk) fails the
save on every rank and removes the partial directory.

Loading is refused unless every file the manifest lists has the recorded size
and sha256 and no other file is present (``verify``). Nothing is unpickled:
shards are safetensors, the manifest JSON. Loading a checkpoint into another layout
lives in ``distlib.checkpoint.relayout``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from distlib.checkpoint import extra_files
from distlib.checkpoint import manifest as manifest_rules
from distlib.comm import agree
from distlib.comm.group import Comm

FORMAT_VERSION = 1
MANIFEST = manifest_rules.MANIFEST_NAME
_STEP_DIR = re.compile(r"step_(\d{8})")

# A save calls hook(point, path) at these points (fault injection: distlib/app/runtime/faults.py):
# shard_written (this rank's file, before its fsync), shards_written (every rank's shard is durable),
# manifest_written (rank 0, before the directory rename), committed.
SaveHook = Callable[[str, Path], None]


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, uncommitted or does not fit the model."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


# -- writing -------------------------------------------------------------------
def _no_hook(point: str, path: Path) -> None:
    pass


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def partial_dir(final: Path) -> Path:
    """The private directory a checkpoint is written into before its commit renames it to ``final``."""
    return final.parent / f".{final.name}.partial"


def begin(final: Path) -> None:
    """Create ``partial_dir(final)``, refusing a ``final`` that exists already."""
    if final.exists():
        raise CheckpointError(f"refusing to overwrite existing checkpoint {final}")
    partial = partial_dir(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if partial.exists():  # left behind by a save that crashed; it was never committed
        shutil.rmtree(partial)
    partial.mkdir()


def write_shard(
    directory: Path,
    rank: int,
    tensors: dict[str, torch.Tensor],
    rank_state: dict,
    hook: SaveHook | None = None,
) -> dict:
    """Write and fsync one rank's shard; returns its manifest entry (name, rank, bytes, sha256).
    The digest is of the file as read back, i.e. of what a later load will see."""
    path = directory / shard_name(rank)
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(path),
        metadata={"rank_state": json.dumps(rank_state)},
    )
    (hook or _no_hook)("shard_written", path)
    _fsync(path)
    return {"path": path.name, "rank": rank, "bytes": path.stat().st_size, "sha256": _sha256_file(path)}


def commit(partial: Path, final: Path, manifest: dict, hook: SaveHook | None = None) -> None:
    """Write the manifest last (temp name, fsync, rename), then publish the directory."""
    hook = hook or _no_hook
    tmp = partial / (MANIFEST + ".tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps(manifest, indent=2).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, partial / MANIFEST)
    _fsync(partial)
    hook("manifest_written", partial / MANIFEST)
    os.rename(partial, final)
    _fsync(final.parent)


def open_save(root: Path, step: int, comm: Comm) -> Path:
    """First part of a save (collective): rank 0 creates the partial directory of ``step``, every
    rank hears whether it could. Returns the final path the commit will publish."""
    final = Path(root) / step_dir_name(step)
    agree.agreed(lambda: begin(final), comm, CheckpointError, rank0_only=True)
    return final


def write_own_shard(
    final: Path, rank: int, tensors: dict[str, torch.Tensor], rank_state: dict, hook: SaveHook | None = None
) -> dict:
    """This rank's part of a save: write, fsync and hash its shard into ``partial_dir(final)``
    (no collective: an async save runs it in a background thread). Returns the manifest entry;
    raises CheckpointError naming the rank and the file."""
    partial = partial_dir(final)
    try:
        return write_shard(partial, rank, tensors, rank_state, hook)
    except Exception as exc:
        raise CheckpointError(
            f"rank {rank} writing {partial / shard_name(rank)}: "
            f"{exc if isinstance(exc, CheckpointError) else f'{type(exc).__name__}: {exc}'}"
        ) from exc


def complete_save(
    final: Path,
    step: int,
    meta: dict,
    written: Callable[[], dict],
    comm: Comm,
    hook: SaveHook | None = None,
    extras: dict[str, Path] | None = None,
) -> Path:
    """Last part of a save (collective): every rank's file entry (``written()``: this rank's, or
    its error) is gathered, and only if every rank wrote its shard rank 0 copies in ``extras``
    (path inside the checkpoint -> rank 0's file) and commits the manifest. Raises
    CheckpointError on every rank if any failed; the partial directory is removed then."""
    hook = hook or _no_hook
    partial = partial_dir(final)
    try:
        reports = agree.agreed_all(written, comm, CheckpointError)  # every rank's file entry, or the error
    except CheckpointError as exc:
        if comm.rank == 0:  # free the space a full disk needs back; nothing here was committed
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"checkpoint save of step {step} failed, nothing committed: {exc}") from exc
    hook("shards_written", partial)
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": comm.size,
        **meta,
        "files": reports,
    }

    def publish() -> None:
        if extras:  # copied in and listed before the manifest: they are part of what commits
            manifest[extra_files.KEY] = extra_files.write(
                partial, extras, {MANIFEST, *(e["path"] for e in reports)}
            )
        commit(partial, final, manifest, hook)

    agree.agreed(publish, comm, CheckpointError, rank0_only=True)
    hook("committed", final)
    return final


def abandon_save(final: Path, written: Callable[[], object], comm: Comm) -> None:
    """Give up a save whose shards are being written (collective): once every rank's ``written()``
    returned or failed, rank 0 removes the partial directory. Nothing is committed."""
    try:
        agree.agreed_all(lambda: (written(), None)[1], comm, CheckpointError)
    except CheckpointError:
        pass  # a failed write is as abandoned as a finished one
    if comm.rank == 0:
        shutil.rmtree(partial_dir(final), ignore_errors=True)


def save(
    root: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    rank_state: dict,
    meta: dict,
    comm: Comm,
    hook: SaveHook | None = None,
    extras: dict[str, Path] | None = None,
) -> Path:
    """Collectively write this rank's shard; rank 0 copies in ``extras`` and commits the manifest.
    Returns the final path. Raises CheckpointError on every rank if any rank failed; the previous
    checkpoints stay as they were. (An async save runs the same three parts, ``write_own_shard``
    in a background thread.)"""
    final = open_save(root, step, comm)
    written = functools.partial(write_own_shard, final, comm.rank, tensors, rank_state, hook)
    return complete_save(final, step, meta, written, comm, hook, extras)


def delete(path: Path) -> None:
    """Delete committed checkpoint ``path`` (rank 0). Which ones and when is the application's
    retention rule (``distlib.app.checkpointing.retention``), its only caller."""
    # Un-commit first (remove the manifest), so a crash mid-delete leaves an ignored directory.
    (path / MANIFEST).unlink()
    shutil.rmtree(path)


# -- reading -------------------------------------------------------------------
def read_manifest(path: Path) -> dict:
    """The committed manifest of checkpoint ``path``, checked field by field (``manifest.check``):
    every reader can index it without meeting a KeyError or a division by a zero world size."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it was never committed")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{manifest_path} does not parse as a checkpoint manifest ({type(exc).__name__}: {exc})"
        ) from exc
    if isinstance(manifest, dict) and manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path}: format_version {manifest.get('format_version')!r}, "
            f"this program reads {FORMAT_VERSION}"
        )
    try:
        manifest_rules.check(manifest, shard_name)
    except manifest_rules.ManifestProblem as exc:
        raise CheckpointError(f"checkpoint {manifest_path}: {exc}") from exc
    return manifest


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path, share: tuple[int, int] = (0, 1)) -> dict:
    """Check that the manifest parses, nothing unlisted is there, every listed file (the shards, then
    the extra files) has its size and (for the files of this ``share`` = (index, count): every
    count-th from index) its sha256. Returns the manifest; raises CheckpointError naming the
    checkpoint, the file, expected and actual."""
    path = Path(path)
    manifest = read_manifest(path)
    entries = manifest["files"] + extra_files.listed(manifest)
    extra = extra_files.unlisted(path, {MANIFEST, *(entry["path"] for entry in entries)})
    if extra:
        raise CheckpointError(f"checkpoint {path}: unexpected file(s) not listed in the manifest: {extra}")
    expected = {e["path"]: f"expected {e['bytes']} bytes with sha256 {e['sha256']}" for e in entries}
    for entry in entries:
        file = path / entry["path"]
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {path}: file {entry['path']} is missing ({expected[entry['path']]})"
            )
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: file {entry['path']} has {size} bytes, "
                f"{expected[entry['path']]} (truncated or overwritten)"
            )
    index, count = share
    for entry in entries[index::count]:
        actual = _sha256_file(path / entry["path"])
        if actual != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint {path}: file {entry['path']} has sha256 {actual}, "
                f"{expected[entry['path']]} (its contents changed)"
            )
    return manifest


def verify_collectively(path: Path, comm: Comm) -> dict:
    """``verify`` with the hashing split over the ranks; every rank returns or raises the same."""
    return agree.agreed(lambda: verify(path, share=(comm.rank, comm.size)), comm, CheckpointError)


def load_shard(path: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, rank_state) of one rank's shard. Call ``verify`` first."""
    file = Path(path) / shard_name(rank)
    try:
        with safetensors.safe_open(str(file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            rank_state = json.loads(f.metadata()["rank_state"])
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        error = f"{type(exc).__name__}: {exc}"
        raise CheckpointError(f"checkpoint {path}: cannot read {file.name}: {error}") from exc
    return tensors, rank_state


def list_committed(root: Path) -> list[Path]:
    """Committed checkpoint directories under ``root``, oldest step first (not yet verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[len("step_") :]))


def quarantine(path: Path) -> Path:
    """Move a damaged checkpoint aside (``step_X.damaged``, ``.damaged-2``, ...): it is kept for
    inspection, no longer listed, and a new save of the same step can be committed."""
    target, n = path.with_name(path.name + ".damaged"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{n}")
    os.rename(path, target)
    return target
