"""A checkpoint save as the run sees it: the one in flight (``checkpoint.async_save``) and the
committed result, and the metrics events that report them.

An async save is taken at step S: the state is copied to host memory (the only part the loop
waits for, with the collective that opens the partial directory), a background thread writes,
fsyncs and hashes this rank's shard, and the ranks commit at the first later step boundary where
``stopping.decide`` says no rank is still writing (or earlier, waiting, when the next save, a
stop, a rollback or the end of the run needs it). ``blocking_s`` is what the loop waited for,
summed over those parts; ``total_s`` runs from the copy to the commit.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from distlib.checkpoint.background import BackgroundWrite
from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.sharded import SaveHook


@dataclass(frozen=True)
class Saved:
    """One committed save: where, its manifest, and how long it took."""
    path: Path
    manifest: dict
    seconds: float                 # from the start of the save to its commit (= total_s)
    step: int = 0
    reason: str = ""
    blocking_s: float = 0.0        # what the training loop waited for (a sync save: all of it)
    write_s: float | None = None   # an async save: its background write, fsync and sha256

    @property
    def bytes(self) -> int:
        return sum(f["bytes"] for f in self.manifest["files"])


@dataclass
class PendingSave:
    """An async save whose shards are being written: what its commit and the run need later."""
    step: int
    reason: str
    final: Path
    meta: dict
    hook: SaveHook | None
    writer: BackgroundWrite
    tensors: dict[str, torch.Tensor]      # the staging buffers' copies (verify_resume compares them)
    rank_state: dict
    params: torch.Tensor | None           # parameter bytes at the save, when verify_resume needs them
    began: float
    blocking_s: float


def report_saved(log, saved: Saved, boundary: int) -> None:
    """The checkpoint_saved event (every rank calls it; rank 0 writes and prints one line)."""
    fields = dict(path=str(saved.path), reason=saved.reason, bytes=saved.bytes, seconds=saved.seconds,
                  blocking_s=saved.blocking_s, total_s=saved.seconds)
    if saved.write_s is None:
        how = f"{saved.seconds:.2f} s"
    else:
        how = (f"async: the loop waited {saved.blocking_s:.3f} s of {saved.seconds:.2f} s, "
               f"committed after step {boundary}")
        fields.update(write_s=saved.write_s, committed_step=boundary, async_save=True)
    log.event("checkpoint_saved", saved.step, say=f"{saved.path} ({saved.bytes} bytes, {how}, {saved.reason})",
              **fields)


def report_failed(log, pending: PendingSave, boundary: int, error: Exception, fatal: bool) -> None:
    """A background save failed: one line and a checkpoint_failed event; nothing was committed."""
    then = "the run stops" if fatal else "training goes on"
    log.event("checkpoint_failed", boundary, say=f"{error}; the previous checkpoint stays the one resume and "
              f"rollback use; {then}", checkpoint_step=pending.step, reason=pending.reason, message=str(error))


class AsyncSaves:
    """The async half of ``checkpointer.Checkpointer`` (which it is a base of: it uses the
    checkpointer's state, save, _meta, _committed, hooks, clock, root, comm and in_flight), with
    the checkpoint part of a step boundary (``boundary``), sync or async."""

    def boundary(self, step: int, decision, log) -> list[Saved]:
        """The checkpoint part of a step boundary, after ``stopping.decide``: commit the async save
        in flight once no rank is still writing (or, waiting for it, before a new save or a stop),
        then take the save ``decision`` asks for. Returns the saves committed here (each logged)."""
        done = []
        if self.in_flight is not None and (decision.writes_done or decision.save or decision.stop):
            done += self.settle(step, log, fatal=bool(decision.stop))
        if decision.save and self.cfg.checkpoint.async_save:
            self.start_save(step, decision.save)
        elif decision.save:
            done.append(self.save(step, decision.save))
            report_saved(log, done[-1], step)
        if decision.stop:
            done += self.settle(step, log, fatal=True)
        return done

    def writing(self) -> bool | None:
        """For ``stopping.decide``: None with checkpoint.async_save off, else whether this rank's
        background write is still running."""
        if not self.cfg.checkpoint.async_save:
            return None
        return self.in_flight is not None and not self.in_flight.writer.done()

    def start_save(self, step: int, reason: str) -> None:
        """checkpoint.async_save: copy the state into the staging buffers, open the partial directory
        (collective) and start this rank's background write; the commit comes at a later boundary.
        At most one save is in flight: the previous one was committed or dropped (its write
        finished), so its staging buffers are free to be written over."""
        assert self.in_flight is None, "at most one save in flight"
        began = time.perf_counter()
        tensors, rank_state = self.state(step, self.optimizer, staging=self.staging)
        params = self.optimizer.params_snapshot() if self.wants_snapshot() else None
        if params is not None:       # these host copies become verify_resume's snapshot at the commit
            self.staging.hand_over()
        meta, hook = self._meta(step), self.hooks.save_hook(step)
        final = checkpoint.open_save(self.root, step, self.comm)
        staging = self.staging

        def write() -> dict:
            staging.wait_copied()    # a CUDA source's copies (the loop did not wait for them)
            return checkpoint.write_own_shard(final, self.comm.rank, tensors, rank_state, hook)
        writer = BackgroundWrite(write)
        staging.lend(writer.done)
        self.clock.saved()
        self.in_flight = PendingSave(step, reason, final, meta, hook, writer, tensors, rank_state, params,
                                     began, time.perf_counter() - began)

    def settle(self, boundary: int, log, fatal: bool) -> list[Saved]:
        """Wait for the async save in flight (if any) and commit it (collective). A failed write is
        reported (one line, a checkpoint_failed event) and nothing is committed: the previous
        checkpoint stays the trusted one; ``fatal`` (a stop, the end of the run) raises it then."""
        pending, self.in_flight = self.in_flight, None
        if pending is None:
            return []
        waited = time.perf_counter()
        try:
            path = checkpoint.complete_save(pending.final, pending.step, pending.meta, pending.writer.result,
                                            self.comm, pending.hook)
        except checkpoint.CheckpointError as exc:
            report_failed(log, pending, boundary, exc, fatal)
            if fatal:
                raise
            return []
        now = time.perf_counter()
        saved = Saved(path, {}, now - pending.began, pending.step, pending.reason,
                      pending.blocking_s + now - waited, pending.writer.seconds)
        # Committed after a later step passed the guard: trusted at once (a stop commits at its own step).
        saved = self._committed(pending.step, path, pending.tensors, pending.rank_state, pending.params, saved,
                                trusted=boundary > pending.step)
        report_saved(log, saved, boundary)
        return [saved]

    def settle_for_rollback(self, trip: int, log) -> None:
        """The guard tripped at step ``trip`` with an async save in flight: if the step after the
        saved one passed the guard, commit it (the newest trusted target); else it holds the bad
        update's state: wait for the writes and drop it (rank 0 removes its partial directory)."""
        if self.in_flight is not None and trip > self.in_flight.step + 1:
            self.settle(trip, log, fatal=False)
        elif self.in_flight is not None:
            pending, self.in_flight = self.in_flight, None
            checkpoint.abandon_save(pending.final, pending.writer.result, self.comm)
            self.say(f"checkpoint: dropped the async save of step {pending.step} (step {trip} tripped the guard)")

