"""Run-level files a checkpoint carries besides its shards (a BPE run's tokenizer, for one).

The application names them (a relative path inside the checkpoint -> the file to copy); rank 0
copies each into the partial directory before the commit (``write``: fsynced, hashed as read
back), and the manifest lists them under ``extra_files`` as it lists the shards under ``files``:
path, bytes, sha256. ``sharded.verify`` checks them like the shards, so a checkpoint is still
exactly what its manifest lists. A checkpoint without any has no ``extra_files`` key: its
manifest is byte for byte what it was before the key existed, and older checkpoints read as
having none. ``copy_listed`` carries them into a resharded or consolidated copy.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from distlib.checkpoint import manifest as manifest_rules

KEY = "extra_files"


def listed(manifest: dict) -> list[dict]:
    """The manifest's extra-file entries ([] for a checkpoint without any)."""
    return manifest.get(KEY, [])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy(source: Path, target: Path) -> tuple[int, str]:
    """``source`` to ``target``, fsynced; (bytes, sha256) of what was written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with open(source, "rb") as src, open(target, "wb") as dst:
        for block in iter(lambda: src.read(1 << 20), b""):
            dst.write(block)
            digest.update(block)
            size += len(block)
        dst.flush()
        os.fsync(dst.fileno())
    return size, digest.hexdigest()


def write(directory: Path, sources: Mapping[str, Path], reserved: set[str]) -> list[dict]:
    """Copy every ``sources`` file to ``directory / name`` (in sorted order of the names; the
    subdirectories they need made and fsynced); their manifest entries. ``reserved``: the names
    the checkpoint uses itself (its shards, the manifest). A name that is not a plain relative
    path raises ManifestProblem; a source that cannot be read, OSError."""
    names = sorted(sources)
    manifest_rules.check_extra_names(names, reserved)
    entries = []
    for name in names:
        size, sha = _copy(Path(sources[name]), directory / name)
        entries.append({"path": name, "bytes": size, "sha256": sha})
    for sub in manifest_rules.extra_dirs(names):  # their entries; the top one is the commit's to fsync
        _fsync_dir(directory / sub)
    return entries


def copy_listed(checkpoint: Path, manifest: dict, out: Path) -> list[Path]:
    """Copy a verified checkpoint's extra files into ``out`` (same relative paths); each copy's
    sha256 must still be the manifest's, or ValueError names the file."""
    written = []
    for entry in listed(manifest):
        target = out / entry["path"]
        _, sha = _copy(Path(checkpoint) / entry["path"], target)
        if sha != entry["sha256"]:
            raise ValueError(
                f"{entry['path']} changed while it was copied (sha256 {sha}, the manifest lists "
                f"{entry['sha256']})"
            )
        written.append(target)
    return written


def unlisted(path: Path, allowed: set[str]) -> list[str]:
    """What is in checkpoint directory ``path`` beyond ``allowed`` (the manifest, the shards and the
    extra files): top-level names as they are, nested ones as relative paths, sorted."""
    dirs = manifest_rules.extra_dirs(sorted(allowed))
    found = []

    def walk(directory: Path, prefix: str) -> None:
        for entry in directory.iterdir():
            name = prefix + entry.name
            if name in allowed:
                continue
            if name in dirs and entry.is_dir() and not entry.is_symlink():
                walk(entry, name + "/")
            else:
                found.append(name)

    walk(Path(path), "")
    return sorted(found)
