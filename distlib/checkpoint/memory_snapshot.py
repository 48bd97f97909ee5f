"""In-memory snapshots: one rank's checkpoint shard kept in host shared memory (``/dev/shm``).

A snapshot is the same bytes a disk checkpoint's shard would hold (``encode``: the safetensors
file of the rank's optimizer partition and RNG tensors, its rank_state in the metadata), so
resuming from it is bitwise the same as resuming from disk. A file in ``/dev/shm`` outlives the
process that wrote it (a SIGKILL, an OOM kill), not the machine.

Layout, one directory per job (``job_dir``)::

    /dev/shm/distlib-<16 hex of sha256(run directory)>/
        step00000012.rank00003.held00003.safetensors   rank 3's shard after step 12, held by rank 3
        step00000012.rank00003.held00003.json          its manifest: step, owner, holder, bytes,
                                                       sha256, the run's fingerprint
        step00000012.rank00001.held00003.safetensors   rank 1's shard: a peer replica (``replica``)
        rank00003.held00003.spare                      the round before's file, which the next
                                                       round of that shard is written into

The data file is written under a temporary name and renamed, then the manifest likewise: a file
without its manifest was never finished and is ignored (and removed). A replica's manifest holds
its owner's sha256, taken before the bytes left it. ``scan`` refuses, names and
removes a snapshot whose bytes do not match its manifest's size and sha256. Nothing is fsynced:
the memory is the medium.

The job identity is the run directory (absolute path): the same across torchrun restarts of a job
(they resume from the same directory) and different for two jobs running at the same time (two
jobs writing one run directory would collide on their checkpoints anyway).

``start_reaper`` starts the process that removes a job's directory once the launcher (the
torchrun agent) exits, whatever way the job ended: workers killed by a signal run no cleanup.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

SHM = Path("/dev/shm")
FORMAT = 1


@dataclass(frozen=True)
class Snapshot:
    step: int
    owner: int  # the rank whose state it is
    holder: int  # the rank that wrote the file (the owner, or its peer for a replica)
    bytes: int
    sha256: str
    fingerprint: str  # the run's shape (world size, layout, model, ...): a snapshot fits only its own
    path: Path  # the data file

    def describe(self) -> dict:
        return {
            "step": self.step,
            "owner": self.owner,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "fingerprint": self.fingerprint,
        }


def job_dir(run_dir: Path | str, base: Path = SHM) -> Path:
    """The job's directory of snapshots: named by the hash of the run directory's absolute path."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return Path(base) / f"distlib-{key}"


def encode(tensors: dict[str, torch.Tensor], rank_state: dict) -> bytes:
    """The bytes of the shard a disk checkpoint would write (``sharded.write_shard``)."""
    return safetensors.torch.save(
        {k: v.contiguous() for k, v in tensors.items()}, metadata={"rank_state": json.dumps(rank_state)}
    )


# safetensors' names of the dtypes ``pieces`` lays out itself, each with its rank in safetensors'
# Dtype enum: a file holds its tensors the highest rank first, then by name (the format's own order)
_DTYPES = {
    torch.bool: ("BOOL", 0),
    torch.uint8: ("U8", 4),
    torch.int8: ("I8", 5),
    torch.int16: ("I16", 9),
    torch.float16: ("F16", 11),
    torch.bfloat16: ("BF16", 12),
    torch.int32: ("I32", 13),
    torch.float32: ("F32", 15),
    torch.float64: ("F64", 17),
    torch.int64: ("I64", 18),
}


def pieces(tensors: dict[str, torch.Tensor], rank_state: dict) -> list:
    """``encode``'s bytes in pieces, in order: the header, then each tensor's bytes read in place
    (no copy on the host), for ``write`` to hash and write one after the other. ``encode`` made
    two fresh buffers of the whole shard (4.0 ms of a 5 MB shard's snapshot, its pages' faults
    most of it). A dtype this does not lay out goes through ``encode``."""
    if any(t.dtype not in _DTYPES for t in tensors.values()):
        return [encode(tensors, rank_state)]
    header: dict = {"__metadata__": {"rank_state": json.dumps(rank_state)}}
    views, start = [], 0
    for name, tensor in sorted(tensors.items(), key=lambda item: (-_DTYPES[item[1].dtype][1], item[0])):
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype][0],
            "shape": list(tensor.shape),
            "data_offsets": [start, start + data.nbytes],
        }
        views.append(data)
        start += data.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # (the format pads its header to 8 bytes)
    return [len(text).to_bytes(8, "little"), text, *views]


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, rank_state) of ``encode``'s bytes."""
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return safetensors.torch.load(data), json.loads(header["__metadata__"]["rank_state"])


def sha256(data: bytes | list) -> str:
    """The hex sha256 of ``data``: bytes, or ``pieces`` (hashed one after the other)."""
    digest = hashlib.sha256()
    for part in data if isinstance(data, list) else [data]:
        digest.update(part)
    return digest.hexdigest()


def _stem(step: int, owner: int, holder: int) -> str:
    return f"step{step:08d}.rank{owner:05d}.held{holder:05d}"


def write(
    directory: Path,
    step: int,
    owner: int,
    holder: int,
    data: bytes | list,
    fingerprint: str,
    digest: str | None = None,
) -> Snapshot:
    """Write ``data`` (bytes, or ``pieces``: written one after the other) and its manifest (each
    to a temporary name, then renamed; the manifest last), with ``digest``: the sha256 of the
    owner's bytes (a replica's, taken where they were made; None: this rank hashes ``data``). The
    data goes into the pages of the holder's spare of ``owner`` where there is one
    (``retire_steps``)."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = _stem(step, owner, holder)
    path = directory / f"{stem}.safetensors"
    parts = data if isinstance(data, list) else [data]
    size = sum(memoryview(part).nbytes for part in parts)
    snap = Snapshot(step, owner, holder, size, digest or sha256(parts), fingerprint, path)
    _write_atomic(path, *parts, reuse=_spare(directory, owner, holder))
    manifest = {
        "format": FORMAT,
        "step": step,
        "owner": owner,
        "holder": holder,
        "bytes": snap.bytes,
        "sha256": snap.sha256,
        "fingerprint": fingerprint,
    }
    _write_atomic(directory / f"{stem}.json", json.dumps(manifest).encode())
    return snap


def _write_atomic(path: Path, *parts, reuse: Path | None = None) -> None:
    """``parts`` into ``path``, written under a temporary name; into ``reuse``'s pages where that
    file exists (a spare: ``retire_steps``), truncated to what was written."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    reused = False
    if reuse is not None:
        with contextlib.suppress(FileNotFoundError):
            os.replace(reuse, tmp)
            reused = True
    with open(tmp, "r+b" if reused else "wb") as f:
        for part in parts:
            f.write(part)
        f.truncate()
    os.replace(tmp, path)


def _spare(directory: Path, owner: int, holder: int) -> Path:
    """The retired file a holder's next snapshot of ``owner`` is written into (no manifest: never
    listed; ``scan`` removes it as unfinished)."""
    return directory / f"rank{owner:05d}.held{holder:05d}.spare"


def _manifest(path: Path) -> Snapshot:
    m = json.loads(path.read_text())
    if m.get("format") != FORMAT:
        raise ValueError(f"format {m.get('format')!r}, this program reads {FORMAT}")
    return Snapshot(
        int(m["step"]),
        int(m["owner"]),
        int(m["holder"]),
        int(m["bytes"]),
        str(m["sha256"]),
        str(m["fingerprint"]),
        path.with_suffix(".safetensors"),
    )


def listing(directory: Path) -> list[Snapshot]:
    """The finished snapshots in ``directory`` (manifest present and readable; not yet verified)."""
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob("*.json")):
        try:
            found.append(_manifest(path))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-removed or foreign: scan() removes it
    return found


def verify(snap: Snapshot) -> bytes:
    """The snapshot's bytes, or ValueError naming the file, expected and actual."""
    try:
        data = snap.path.read_bytes()
    except OSError as exc:
        raise ValueError(f"memory snapshot {snap.path}: cannot read it ({exc})") from exc
    if len(data) != snap.bytes:
        raise ValueError(f"memory snapshot {snap.path}: {len(data)} bytes, expected {snap.bytes}")
    actual = sha256(data)
    if actual != snap.sha256:
        raise ValueError(
            f"memory snapshot {snap.path}: sha256 {actual}, expected {snap.sha256} (its contents changed)"
        )
    return data


def scan(directory: Path, share: tuple[int, int] = (0, 1)) -> tuple[list[Snapshot], list[str]]:
    """(intact snapshots, problems): every finished snapshot in ``directory``; those of this
    ``share`` = (index, count) are hashed, and a damaged one is named in problems and removed.
    Unfinished files (no manifest, a temporary name) are removed too."""
    found = listing(directory)
    index, count = share
    intact, problems = [], []
    for i, snap in enumerate(found):
        if i % count != index:
            intact.append(snap)
            continue
        try:
            verify(snap)
            intact.append(snap)
        except ValueError as exc:
            problems.append(str(exc))
            remove(snap)
    if directory.is_dir() and index == 0:
        finished = {s.path.name for s in found} | {s.path.with_suffix(".json").name for s in found}
        for path in directory.iterdir():
            if path.name not in finished and ".tmp" not in path.name:  # (a temporary: someone writing)
                path.unlink(missing_ok=True)
    return intact, problems


def remove(snap: Snapshot) -> None:
    """Manifest first: a half-removed snapshot is never listed."""
    snap.path.with_suffix(".json").unlink(missing_ok=True)
    snap.path.unlink(missing_ok=True)


def remove_steps(directory: Path, keep, holder: int | None = None, leave: Container[int] = ()) -> int:
    """Remove every snapshot in ``directory`` whose step is not ``keep(step)`` (of ``holder`` only,
    if given; none of a holder in ``leave``); returns the bytes freed."""
    freed = 0
    for snap in listing(directory):
        if not keep(snap.step) and (holder is None or snap.holder == holder) and snap.holder not in leave:
            remove(snap)
            freed += snap.bytes
    return freed


def retire_steps(directory: Path, step: int, holder: int) -> None:
    """Remove ``holder``'s snapshots of steps other than ``step``, the newest of each owner's data
    file kept as that owner's spare: the next snapshot is written into its pages. Writing 5 MB
    took 2.2 ms into a fresh file (its page faults and zeroing), 0.6 into a spare, and freeing a
    file 0.7; so a holder keeps two files of each owner between rounds, what it held during each
    round's write already."""
    mine = (s for s in listing(directory) if s.holder == holder and s.step != step)
    older = sorted(mine, key=lambda s: s.step)
    newest = {snap.owner: snap for snap in older}
    for snap in older:
        if newest[snap.owner] is not snap:
            remove(snap)
            continue
        snap.path.with_suffix(".json").unlink(missing_ok=True)  # (manifest first: never listed again)
        with contextlib.suppress(FileNotFoundError):  # (a node's rank 0 may have removed it: no spare)
            os.replace(snap.path, _spare(directory, snap.owner, holder))


def clean(directory: Path) -> None:
    """Remove the job's directory and everything in it."""
    shutil.rmtree(directory, ignore_errors=True)


# The reaper: a tiny process outside the worker's process group (a new session) that waits for the
# launcher to exit (polling every 0.1 s), then removes the job's directory. It imports nothing of
# torch (starts in ~20 ms).
_REAPER = """
import os, shutil, sys, time
pid, directory = int(sys.argv[1]), sys.argv[2]
def gone():
    try:  # a zombie (exited, not yet reaped by its own parent) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
while not gone():
    time.sleep(0.1)
shutil.rmtree(directory, ignore_errors=True)
"""


def start_reaper(launcher_pid: int, directory: Path) -> subprocess.Popen:
    """Remove ``directory`` once process ``launcher_pid`` has exited (finished, failed or killed)."""
    return subprocess.Popen(
        [sys.executable, "-c", _REAPER, str(launcher_pid), str(directory)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
