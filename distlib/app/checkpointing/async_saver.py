"""``checkpoint.async_save``: a save whose shard is written in the background, and what a save is.

An async save is taken at step S: the state is copied into host staging buffers kept across saves
(the only part the loop waits for, with the collective that opens the partial directory), a
background thread writes, fsyncs and hashes this rank's shard, and the ranks commit it at a
later step boundary (``Checkpointer.boundary``): the first one where no rank is still writing, or
earlier, waiting, when the next save, a stop, a rollback or the end of the run needs it. At most
one save is in flight, so its staging buffers are free again when the next one starts.
``blocking_s`` is what the loop waited for, summed over those parts; ``total_s`` runs from the
copy to the commit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from distlib.checkpoint import extra_files
from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.background import BackgroundWrite
from distlib.checkpoint.sharded import SaveHook
from distlib.checkpoint.staging import StagingBuffers
from distlib.comm.group import Comm


@dataclass(frozen=True)
class Saved:
    """One committed save: where, its manifest, and how long it took."""

    path: Path
    manifest: dict
    seconds: float  # from the start of the save to its commit (= total_s)
    step: int = 0
    reason: str = ""
    blocking_s: float = 0.0  # what the training loop waited for (a sync save: all of it)
    write_s: float | None = None  # an async save: its background write, fsync and sha256

    @property
    def bytes(self) -> int:
        return sum(f["bytes"] for f in self.manifest["files"] + extra_files.listed(self.manifest))


@dataclass
class PendingSave:
    """An async save whose shards are being written: what its commit and the run need later."""

    step: int
    reason: str
    final: Path
    meta: dict
    hook: SaveHook | None
    writer: BackgroundWrite
    tensors: dict[str, torch.Tensor]  # the staging buffers' copies (the resume check compares them)
    rank_state: dict
    params: torch.Tensor | None  # parameter bytes at the save, when the resume check needs them
    began: float
    blocking_s: float
    extras: dict[str, Path] | None = None  # run-level files rank 0 copies in at the commit


class AsyncSaveFailed(checkpoint.CheckpointError):
    """A background save's write or commit failed; nothing was committed."""

    def __init__(self, error: checkpoint.CheckpointError, pending: PendingSave):
        super().__init__(str(error))
        self.pending = pending


class AsyncSaver:
    def __init__(self, comm: Comm):
        self.comm = comm
        self.staging = StagingBuffers()  # host copies, reused from save to save
        self.in_flight: PendingSave | None = None

    def writing(self) -> bool:
        """Whether this rank's background write is still running."""
        return self.in_flight is not None and not self.in_flight.writer.done()

    def start(
        self,
        root: Path,
        step: int,
        reason: str,
        state: tuple[dict, dict],
        meta: dict,
        hook: SaveHook | None,
        params: torch.Tensor | None,
        began: float,
        extras: dict[str, Path] | None = None,
    ) -> None:
        """Open the partial directory (collective) and start writing ``state`` (staged in
        ``self.staging`` by the caller) in the background; the commit comes later (``commit``)."""
        assert self.in_flight is None, "at most one save in flight"
        tensors, rank_state = state
        final = checkpoint.open_save(root, step, self.comm)
        staging, rank = self.staging, self.comm.rank

        def write() -> dict:
            staging.wait_copied()  # a CUDA source's copies (the loop did not wait for them)
            return checkpoint.write_own_shard(final, rank, tensors, rank_state, hook)

        writer = BackgroundWrite(write)
        staging.lend(writer.done)
        self.in_flight = PendingSave(
            step,
            reason,
            final,
            meta,
            hook,
            writer,
            tensors,
            rank_state,
            params,
            began,
            time.perf_counter() - began,
            extras,
        )

    def commit(self) -> tuple[PendingSave, Saved] | None:
        """Wait for the save in flight (if any) and commit it (collective): the pending save and
        what was saved. A failed write raises AsyncSaveFailed and nothing is committed."""
        pending, self.in_flight = self.in_flight, None
        if pending is None:
            return None
        waited = time.perf_counter()
        try:
            path = checkpoint.complete_save(
                pending.final,
                pending.step,
                pending.meta,
                pending.writer.result,
                self.comm,
                pending.hook,
                pending.extras,
            )
        except checkpoint.CheckpointError as exc:
            raise AsyncSaveFailed(exc, pending) from exc
        now = time.perf_counter()
        return pending, Saved(
            path,
            {},
            now - pending.began,
            pending.step,
            pending.reason,
            pending.blocking_s + now - waited,
            pending.writer.seconds,
        )

    def drop(self) -> PendingSave | None:
        """Wait for the writes of the save in flight and commit nothing (rank 0 removes its partial
        directory; collective)."""
        pending, self.in_flight = self.in_flight, None
        if pending is not None:
            checkpoint.abandon_save(pending.final, pending.writer.result, self.comm)
        return pending


def report_saved(log, saved: Saved, boundary: int) -> None:
    """The checkpoint_saved event (every rank calls it; rank 0 writes and prints one line)."""
    fields = dict(
        path=str(saved.path),
        reason=saved.reason,
        bytes=saved.bytes,
        seconds=saved.seconds,
        blocking_s=saved.blocking_s,
        total_s=saved.seconds,
    )
    if saved.write_s is None:
        how = f"{saved.seconds:.2f} s"
    else:
        how = (
            f"async: the loop waited {saved.blocking_s:.3f} s of {saved.seconds:.2f} s, "
            f"committed after step {boundary}"
        )
        fields.update(write_s=saved.write_s, committed_step=boundary, async_save=True)
    log.event(
        "checkpoint_saved",
        saved.step,
        say=f"{saved.path} ({saved.bytes} bytes, {how}, {saved.reason})",
        **fields,
    )


def report_failed(log, pending: PendingSave, boundary: int, error: Exception, fatal: bool) -> None:
    """A background save failed: one line and a checkpoint_failed event; nothing was committed."""
    then = "the run stops" if fatal else "training goes on"
    log.event(
        "checkpoint_failed",
        boundary,
        say=f"{error}; the previous checkpoint stays the one resume and rollback use; {then}",
        checkpoint_step=pending.step,
        reason=pending.reason,
        message=str(error),
    )
