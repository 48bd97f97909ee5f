"""Every checkpoint decision of a run, behind the few calls the Trainer makes.

    resume()          fresh start, an explicit checkpoint, or "latest" (the newest that verifies;
                      damaged newer ones are moved aside); loads it; returns the step to continue after
    save(step)        this run's state, committed through ``checkpoint.save``; retention (keep_last)
    step_passed()     the guard accepted the step after a save: that checkpoint is trusted (then pruned)
    finish()          the end of the run: the last checkpoint is as trusted as it will get
    load(...)         verify, check that it fits (``fit_check``: every difference listed), restore;
                      nothing is loaded unless all of it fits
    restore(point)    a rollback target: a checkpoint, or the starting state kept in memory
    verify_resume()   reload the snapshot's checkpoint into a fresh model and compare every byte

The checkpoint file format, its commit protocol and resharding live in ``distlib.checkpoint``;
this module decides what goes into a checkpoint of this application and when. Which checkpoints
may be rolled back to (``unattended.rollback.RollbackTargets``) is kept here too, because
retention must never delete the newest trusted one.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from distlib.checkpoint import reshard
from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.staging import StagingBuffers
from distlib.comm import agree
from distlib.comm.group import Comm
from distlib.comm.mesh import Mesh
from distlib.app.config.run import RunConfig
from distlib.app.data.batches import GlobalBatches
from distlib.app.checkpointing.fit_check import check_fits
from distlib.app.checkpointing.manifest_config import manifest_config
from distlib.app.hooks import StepHooks
from distlib.app.model.pipeline import stage_layouts
from distlib.app.checkpointing.async_saver import AsyncSaves, PendingSave, Saved
from distlib.app.checkpointing.memory_snapshots import MemorySnapshots, fingerprint
from distlib.app.checkpointing.resume_check import ResumeCheck, verify_resume
from distlib.app.checkpointing.rng import seed_process_rngs
from distlib.app.unattended.rollback import RollbackPoint, RollbackTargets
from distlib.app.unattended.stopping import CheckpointClock
from distlib.parallel.tensor_parallel import Split, manifest_layouts
from distlib.parallel.zero import ZeroOptimizer


class Checkpointer(AsyncSaves):
    def __init__(self, cfg: RunConfig, comm: Comm, mesh: Mesh, run_dir: Path, data: GlobalBatches,
                 model: torch.nn.Module, optimizer: ZeroOptimizer, tp_splits: dict[str, Split], hooks: StepHooks,
                 clock: Callable[[], float]):
        self.cfg, self.comm, self.mesh, self.data, self.hooks = cfg, comm, mesh, data, hooks
        self.model, self.optimizer = model, optimizer      # the run's; load() also fills fresh ones
        self.tp_splits = tp_splits                         # parameter name -> its tensor-parallel Split
        self.root = Path(run_dir) / cfg.checkpoint.dir
        self.clock = CheckpointClock(cfg.checkpoint.every_minutes, clock)   # rank 0's decides every_minutes
        self.targets = RollbackTargets(None)    # replaced by resume(): the run's starting state
        # (step, tensors, rank_state, params) of the checkpoint verify_resume reloads at the end
        self.snapshot: tuple[int, dict, dict, torch.Tensor] | None = None
        self.in_flight: PendingSave | None = None   # checkpoint.async_save: written, not yet committed
        self.memory = MemorySnapshots(cfg.checkpoint.memory_every_steps, comm, run_dir,
                                      lambda: fingerprint(self._meta(0), comm.size), self.say)
        self.staging = StagingBuffers()             # checkpoint.async_save: host copies, reused
        self.pp_meta = stage_layouts(mesh, optimizer.layout, tp_splits)   # (collective; {} at dist.pp=1)

    def say(self, message: str) -> None:
        if self.comm.rank == 0:
            print(message, flush=True)

    # -- starting ---------------------------------------------------------------
    def resume(self) -> tuple[int, Path | None]:
        """Load what checkpoint.resume names (if anything); (the step to continue after, its path).
        With the guard on, that state is the first rollback target."""
        snapped = self.memory.resume(self.cfg.checkpoint.resume == "latest", self.root)   # a RollbackPoint
        path, verified = (None, False) if snapped else self.resolve_resume()
        start = snapped.step if snapped else 0
        if snapped:
            self.restore(snapped)
        elif path is not None:
            start = self.load(path, self.model, self.optimizer, verified)
            self.say(f"resumed from {path} at step {start}")
        if self.cfg.guard.enabled:
            self.targets = RollbackTargets(RollbackPoint(start, path) if path
                                           else RollbackPoint(start, None, self.state(start, self.optimizer)))
        return start, self.memory.dir if snapped else path

    def resolve_resume(self) -> tuple[Path | None, bool]:
        """(checkpoint to resume from or None, whether it has been verified already). For "latest",
        the ranks verify the candidates together, newest first; damaged ones are moved aside."""
        resume = self.cfg.checkpoint.resume
        if resume not in (None, "", "none", "null") and resume != "latest":
            return Path(resume), False
        listing = agree.agreed(lambda: [str(p) for p in checkpoint.list_committed(self.root)], self.comm,
                               checkpoint.CheckpointError, rank0_only=True)
        candidates = [Path(p) for p in listing]
        if resume != "latest":
            if candidates:
                raise fresh_run_collision(self.root, candidates[-1])
            return None, False
        damaged = []
        for path in reversed(candidates):
            try:
                checkpoint.verify_collectively(path, self.comm)
            except checkpoint.CheckpointError as exc:
                damaged.append((path, str(exc)))
                continue
            break
        else:
            if damaged:
                raise checkpoint.CheckpointError(
                    f"checkpoint.resume=latest: none of the {len(damaged)} checkpoint(s) in {self.root} "
                    f"verifies; the newest: {damaged[0][1]}")
            self.say(f"resume: no checkpoint in {self.root}; starting fresh")
            return None, False
        if self.comm.rank == 0:
            for bad, problem in damaged:
                # Moved aside, not deleted: kept for inspection, and the rerun can save that step again.
                print(f"resume: skipping a damaged checkpoint (moved to {checkpoint.quarantine(bad)}): {problem}",
                      file=sys.stderr, flush=True)
        self.say(f"resume: latest valid checkpoint is {path}")
        return path, True

    # -- saving ---------------------------------------------------------------
    def state(self, step: int, optimizer: ZeroOptimizer, skipped: int | None = None,
              staging: StagingBuffers | None = None) -> tuple[dict, dict]:
        """(tensors, rank_state) of this rank: optimizer partition (fresh host copies, or copied
        into ``staging``'s reused buffers), RNG, step and data position."""
        skipped = self.data.skipped if skipped is None else skipped
        rng_tensors, rng_meta = checkpoint.capture_rng(optimizer.device)
        shard = optimizer.state_shard() if staging is None else staging.stage(optimizer.state_views())
        tensors = {**shard, **rng_tensors}
        rank_state = {"step": step, "optimizer_steps": optimizer.step_count,
                      "data": self.data.position(step, skipped), "rng": rng_meta}
        if skipped:
            rank_state["skipped_batches"] = skipped
        return tensors, rank_state

    def _meta(self, step: int) -> dict:
        """The manifest's run-wide part for a save after ``step``."""
        meta = {"zero_stage": self.cfg.zero.stage, "seed": self.cfg.seed,
                "model": dataclasses.asdict(self.cfg.model), "data": self.data.position(step),
                "data_config": dataclasses.asdict(self.cfg.data), "layout": self.optimizer.layout.to_dict(),
                **self._parallel_meta()}
        if self.data.skipped:     # guard.skip_batches: part of the data position (docs/unattended.md)
            meta["skipped_batches"] = self.data.skipped
        return meta

    def save(self, step: int, reason: str = "") -> Saved:
        """Commit this run's state after ``step`` (collective), then apply retention: at once with the
        guard off, else when the checkpoint becomes trusted (``step_passed``)."""
        began = time.perf_counter()
        tensors, rank_state = self.state(step, self.optimizer)
        path = checkpoint.save(self.root, step, tensors, rank_state, self._meta(step), self.comm,
                               self.hooks.save_hook(step))
        self.clock.saved()
        params = self.optimizer.params_snapshot() if self.wants_snapshot() else None
        seconds = time.perf_counter() - began
        return self._committed(step, path, tensors, rank_state, params,
                               Saved(path, {}, seconds, step, reason, seconds), trusted=False)

    def boundary(self, step: int, decision, log) -> list[Saved]:
        """AsyncSaves.boundary, then (checkpoint.memory_every_steps) the in-memory snapshot."""
        done = super().boundary(step, decision, log)
        self.memory.after_step(step, lambda: self.state(step, self.optimizer))
        return done

    def wants_snapshot(self) -> bool:
        """Whether the next save becomes verify_resume's snapshot: the first one, or with keep_last
        (which may prune the first checkpoint; the newest never) every one."""
        return self.cfg.checkpoint.verify_resume and (self.snapshot is None or bool(self.cfg.checkpoint.keep_last))

    def _committed(self, step: int, path: Path, tensors: dict, rank_state: dict, params: torch.Tensor | None,
                   saved: Saved, trusted: bool) -> Saved:
        """Bookkeeping of a committed save: verify_resume's snapshot, rollback targets, retention."""
        manifest = checkpoint.read_manifest(path)
        if params is not None:
            if self.snapshot is not None:     # its tensors are read no more: the next async save's buffers
                self.staging.take_back(self.snapshot[1])
            self.snapshot = (step, tensors, rank_state, params)
        if self.targets.saved_checkpoint(step, path, trusted) or not self.cfg.guard.enabled:
            self.prune()
        return dataclasses.replace(saved, manifest=manifest)

    def step_passed(self) -> None:
        """The guard accepted a step: a checkpoint saved after the previous one is trusted now."""
        if self.targets.step_passed():
            self.prune()

    def finish(self, step: int, log) -> list[Saved]:
        """The end of the run: an async save in flight is waited for and committed (a failure
        raises), then the last checkpoint is as trusted as it will get."""
        done = self.settle(step, log, fatal=True)
        self.memory.finish()
        if self.targets.pending is not None:
            self.prune()
        return done

    def prune(self) -> None:
        """checkpoint.keep_last: rank 0 deletes all but the newest K committed checkpoints, and every
        rank forgets them as rollback targets. With the guard on it runs when a checkpoint becomes
        trusted (and at the end), so the newest trusted rollback target is never deleted."""
        keep = self.cfg.checkpoint.keep_last
        if not keep:
            return

        def remove() -> list[str]:
            removed = []
            try:
                removed = [str(p) for p in checkpoint.prune(self.root, keep)]
                for old in removed:
                    print(f"checkpoint: removed {old} (checkpoint.keep_last={keep})")
            except OSError as exc:  # training can go on; the operator must hear about it
                print(f"warning: checkpoint.keep_last could not remove an old checkpoint: {exc}", file=sys.stderr)
            return removed

        self.targets.forget(agree.agreed(remove, self.comm, checkpoint.CheckpointError, rank0_only=True))

    def _parallel_meta(self) -> dict:
        """The mesh, and with tensor parallelism each TP rank's flat layout with how every local
        parameter maps to the full one (split dim, groups, index), so the shards can be reassembled."""
        tp = self.mesh.tp.size
        meta = {"tp": tp, "dp": self.mesh.dp.size, "rank_order": "global rank = dp_rank * tp + tp_rank",
                "param_dtype": self.cfg.train.dtype}
        if tp > 1:
            meta["tp_layouts"] = manifest_layouts(self.optimizer.layout.to_dict(), self.tp_splits)
        return {**meta, **self.pp_meta} if self.pp_meta else meta

    # -- loading --------------------------------------------------------------
    def load(self, path: Path, model: torch.nn.Module, optimizer: ZeroOptimizer, verified: bool = False) -> int:
        """Verify ``path`` (the ranks hash its files between them and share the verdict), check it fits,
        then restore this rank's optimizer partition (resharded if the checkpoint's world size
        differs), parameters, RNG and data position. Nothing is loaded unless all of it fits.
        Returns the checkpoint's step. (``model`` is the one ``optimizer`` updates.)"""
        path = Path(path)
        if not verified:
            checkpoint.verify_collectively(path, self.comm)
        manifest = agree.agreed(lambda: _read_checked(path), self.comm, checkpoint.CheckpointError)
        check_fits(path, manifest, optimizer.layout, self.cfg, self.mesh.tp.size, self.mesh.tp.rank, self.data)
        state, rank_state, rng = agree.agreed(
            lambda: reshard.load_partition(path, manifest, self.mesh.dp.rank, self.mesh.dp.size, self.mesh.tp.rank,
                                           (optimizer.layout, *((self.mesh.pp.rank, self.mesh.pp.size) if self.mesh.pp
                                                                else (0, 1)))),
            self.comm, checkpoint.CheckpointError)
        optimizer.load_state_shard(state, rank_state["optimizer_steps"])
        if rng is not None:
            checkpoint.restore_rng(rng, rank_state["rng"])
            checkpoint.restore_device_rng(rng, optimizer.device)
        else:
            seed_process_rngs(self.cfg.seed, self.mesh.dp.rank)
        if optimizer is self.optimizer:   # (verify_resume loads into a second optimizer: not the run's data)
            self.data.skipped = int(manifest.get("skipped_batches", 0))
        reseeded = [r for r, (had,) in enumerate(agree.gather([float(rng is not None)], self.comm)) if not had]
        if manifest["world_size"] != self.comm.size:
            self.say(f"resharded checkpoint {path}: saved by {manifest['world_size']} rank(s) at ZeRO stage "
                     f"{manifest.get('zero_stage')}, loaded into {self.comm.size} at stage {self.cfg.zero.stage}; "
                     f"the data position carries over (same global batch, {self.cfg.global_batch})")
        if reseeded:
            self.say(f"rank(s) {reseeded} have no saved RNG state in {path} (it was saved by fewer ranks): "
                     f"re-seeded from seed + rank; dropout draws differ from the original run")
        return int(manifest["step"])

    def restore(self, point: RollbackPoint) -> None:
        """Return the run to a rollback target: a checkpoint (``load``) or the state kept in memory."""
        if point.path is not None:
            self.load(point.path, self.model, self.optimizer)
            return
        tensors, rank_state = point.state
        self.optimizer.load_state_shard(tensors, rank_state["optimizer_steps"])
        checkpoint.restore_rng(tensors, rank_state["rng"])
        checkpoint.restore_device_rng(tensors, self.optimizer.device)
        self.data.skipped = rank_state.get("skipped_batches", 0)

    def rolled_back_to(self, target: RollbackPoint, trip: int) -> list[str]:
        """After a rollback to ``target``: this run's later checkpoints are moved aside (their new
        paths returned) and none of them is the one verify_resume reloads."""
        set_aside = self.targets.rolled_back_to(target, trip, self.root, self.comm)
        self.memory.rolled_back(target.step)
        if self.snapshot is not None and self.snapshot[0] > target.step:
            self.snapshot = None
        return set_aside

    # -- the resume check (invariant 4): resume_check.py ------------------------
    def verify_resume(self, build: Callable[[], tuple[torch.nn.Module, ZeroOptimizer]]) -> ResumeCheck | None:
        return verify_resume(self, build)


def _read_checked(path: Path) -> dict:
    """The manifest at ``path``, its run configuration checked like a run's own."""
    manifest = checkpoint.read_manifest(path)
    manifest_config(manifest, path)
    return manifest


def fresh_run_collision(root: Path, newest: Path) -> checkpoint.CheckpointError:
    """A fresh run into ``root`` would collide with (and never overwrite) its checkpoints."""
    return checkpoint.CheckpointError(
        f"{root} already holds checkpoint(s) up to {newest.name}; pass checkpoint.resume=latest to "
        f"continue that run, or choose a new hydra.run.dir")


def refuse_fresh_run_over_checkpoints(root: Path, resume: str | None) -> None:
    """Before anything is written (train.py calls it before Hydra's files): a run that does not
    resume must not start in a directory that already holds committed checkpoints."""
    if resume in (None, "", "none", "null"):
        committed = checkpoint.list_committed(root)
        if committed:
            raise fresh_run_collision(root, committed[-1])
