"""Which members of a group share a host, and giving such a group its shared-memory transport.

A host is named by the rendezvous, not guessed: every rank publishes its host key (the host name,
its boot id, and torchrun's node rank, so the simulated nodes of one machine stay apart) and the
world gathers them once (``host_keys``). A group whose members all share a key gets a segment of
its own (``attach``: collective over the group, through gloo, which the group keeps for what is
not a message of ours: barriers, torch's own collectives); any other group keeps gloo's pairs.

The segment is a file in ``/dev/shm`` (or ``DISTLIB_SHM_DIR``) that the group's first member creates
and unlinks as soon as every member has mapped it: from then on it is memory the kernel frees with
the last process, however it ends. A file that outlived its creator (killed between creating and
unlinking it) is removed by the next ``create`` on the host.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import socket
import sys
import uuid
from pathlib import Path

import torch

from distlib.comm import board, shm
from distlib.comm.collectives import all_gather_bytes
from distlib.comm.group import Comm

PREFIX = "distlib-comm-"

# Bytes per ring: 1 MiB up to 8 members (56 rings), then less, so a segment stays near 64 MiB, but
# never under 128 KiB: every header-check message (72 B + 64 KiB inlined) must fit whole, or one
# could still wait in its ring after its collective ended while its sender waits on another group.
CAPACITY, MIN_CAPACITY, SEGMENT_BUDGET = 1 << 20, 128 << 10, 64 << 20


def capacity_for(n: int) -> int:
    """The ring size of a segment of ``n`` members (a multiple of 8)."""
    return max(MIN_CAPACITY, min(CAPACITY, SEGMENT_BUDGET // max(1, n * (n - 1)))) // 8 * 8


def host_key() -> str:
    boot = Path("/proc/sys/kernel/random/boot_id")
    booted = boot.read_text().strip() if boot.exists() else ""
    return f"{socket.gethostname()}/{booted}/node{os.environ.get('GROUP_RANK', '0')}"


def host_keys(world: Comm) -> list[str]:
    """Every rank's host key, by global rank (collective over ``world``)."""
    bare = dataclasses.replace(world, stats=None, check=False, transport=None)
    return [key.decode() for key in all_gather_bytes(host_key().encode(), bare)]


def attach(
    comm: Comm,
    hosts: list[str] | None,
    timeout_s: float,
    capacity: int | None = None,
    slot: int | None = None,
) -> Comm:
    """``comm`` with a shared-memory transport when its members share a host and its messages
    travel on the CPU; otherwise ``comm`` as it is. Collective over ``comm`` (call on every member);
    ``hosts``: ``host_keys`` of the world, or None where the members are known to share one;
    ``capacity``: bytes per ring (a longer message streams through it; default ``capacity_for``);
    ``slot``: bytes per member on the board the collectives read from (default ``board.slot_for``;
    0: no board, every collective goes through the rings)."""
    if comm.size == 1 or comm.device != "cpu" or not shm.supported():
        return comm
    if hosts is not None and len({hosts[r] for r in comm.ranks}) > 1:
        return comm
    bare = dataclasses.replace(comm, stats=None, check=False, transport=None)
    capacity = capacity if capacity is not None else capacity_for(comm.size)
    slot = slot if slot is not None else board.slot_for(comm.size)
    path = create(comm.size, capacity, slot) if comm.rank == 0 else ""
    path = all_gather_bytes(path.encode(), bare)[0].decode()
    if not path:
        return _keep_gloo(comm, f"no segment could be created in {shm_dir()}")
    transport, problem = None, b""
    try:
        transport = open_segment(path, comm.size, comm.rank, timeout_s, capacity, slot)
    except OSError as exc:  # this member cannot map it: every member keeps gloo, and it says why
        problem = f"rank {comm.peer(comm.rank)} could not map {path}: {exc}".encode()
    mapped = all_gather_bytes(problem, bare)
    if comm.rank == 0:
        Path(path).unlink(missing_ok=True)  # every member mapped it (or failed): nothing stays on disk
    if any(mapped):
        return _keep_gloo(comm, next(p for p in mapped if p).decode())
    return dataclasses.replace(comm, transport=transport)


def _keep_gloo(comm: Comm, why: str) -> Comm:
    """The group without a segment (its messages go over gloo's pairs, slower, the same bytes)."""
    if comm.rank == 0:
        print(f"warning: dist.transport=shm: {why}; group {list(comm.ranks)} uses gloo", file=sys.stderr)
    return comm


def shm_dir() -> Path:
    return Path(os.environ.get("DISTLIB_SHM_DIR", "/dev/shm"))


def board_offset(n: int, capacity: int) -> int:
    """Where the board starts: after the rings, on a cache line of its own."""
    return (shm.layout_bytes(n, capacity) + 63) // 64 * 64


def segment_bytes(n: int, capacity: int, slot: int) -> int:
    """The rings, then the board."""
    return board_offset(n, capacity) + board.board_bytes(n, slot)


def create(n: int, capacity: int, slot: int = 0) -> str:
    """Create a segment for ``n`` members (the group's first calls it); returns its path, or ""
    where the memory cannot be reserved (the group then keeps gloo). Stale segments go first."""
    if capacity < 8 or capacity % 8:
        raise ValueError(f"ring capacity {capacity} must be a positive multiple of 8 bytes")
    if slot < 0 or slot % 64 or 0 < slot < 8 * n:
        raise ValueError(
            f"board slot {slot} must be a multiple of 64 bytes, at least 8 per member (0: no board)"
        )
    reap()
    path = shm_dir() / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return ""
    try:
        os.posix_fallocate(fd, 0, segment_bytes(n, capacity, slot))  # ENOSPC here, not SIGBUS on first touch
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        return ""
    os.close(fd)
    return str(path)


def open_segment(path: str, n: int, me: int, timeout_s: float, capacity: int, slot: int = 0) -> shm.Transport:
    """Map the segment at ``path`` as member ``me`` of ``n``."""
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, segment_bytes(n, capacity, slot))
    finally:
        os.close(fd)
    transport = shm.Transport(mm, n, me, capacity, timeout_s)
    if slot:
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        transport.board = board.Board(transport, flat, board_offset(n, capacity), slot)
    return transport


def reap() -> None:
    """Remove segments whose creator is gone: one killed between creating and unlinking its file."""
    for path in shm_dir().glob(PREFIX + "*"):
        pid = path.name[len(PREFIX) :].partition("-")[0]
        if pid.isdigit() and shm.exited(int(pid)):
            path.unlink(missing_ok=True)
