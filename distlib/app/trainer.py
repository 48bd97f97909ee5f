"""The training loop: forward, backward, one ZeRO step, logging, checkpoints.

It composes narrow APIs in order and knows nothing about how they talk:
``broadcast_module_`` (initial broadcast), ``ZeroOptimizer.sync_grads/apply_update``
(gradient sync, then update + parameter all-gather), ``guard.check_step`` (the
collective verdict between the two), ``schedule.decide`` (save / stop after this
step), ``checkpoint.save/verify/load_shard``, ``metrics.MetricsLog``, and
``agree`` for the few values ranks must share (per-rank norms, memory reports).
Every step runs inside ``watchdog.watch``, which turns a timed-out collective
into an error naming the step and the ranks that did not arrive.

On a guard trip no update is applied and the run returns to the newest trusted
state (``distlib.rollback``), then re-runs the steps from there (docs/unattended.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from distlib.comm import agree
from distlib.checkpoint import sharded as checkpoint
from distlib.app import data
from distlib.app.unattended import guard
from distlib.checkpoint import reshard
from distlib.app.unattended import stopping as schedule
from distlib.comm import watchdog
from distlib.comm.group import Comm
from distlib.app.config import RunConfig
from distlib.app.data import BatchPlan
from distlib.parallel.broadcast import broadcast_module_
from distlib.app.unattended.faults import Faults
from distlib.parallel.flat_layout import FlatLayout
from distlib.comm.mesh import build_mesh
from distlib.app.metrics import MetricsLog, json_number
from distlib.app.model import MiniGPT, build_model, shard_model_
from distlib.app.unattended.rollback import RollbackPoint, RollbackTargets
from distlib.parallel.tensor_parallel import manifest_layouts
from distlib.parallel.zero import ZeroOptimizer, make_optimizer


@dataclass
class StepLog:
    step: int
    loss: float
    grad_norm: float
    param_norms: list[float]     # one per rank, after the update
    seconds: float
    val_loss: float | None = None  # held-out loss after this step, on evaluation steps


@dataclass
class ResumeCheck:
    step: int
    mismatches: list[str]        # "rank R: what differed"; empty means byte-identical

    @property
    def ok(self) -> bool:
        return not self.mismatches


@dataclass
class RunResult:
    start_step: int
    steps: list[StepLog] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)   # per rank: measured / expected / allowance
    manifests: list[dict] = field(default_factory=list)
    resume_check: ResumeCheck | None = None
    numel: int = 0
    rollbacks: list[dict] = field(default_factory=list)   # one per guard trip that rolled back
    stopped_by: str | None = None                        # e.g. "SIGTERM": saved and left early


def seed_process_rngs(seed: int, rank: int) -> None:
    """Seed the global torch / numpy / python RNGs (dropout and anything else that draws from
    them), differently per rank, so that two runs of the same config are byte-identical."""
    torch.manual_seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    random.seed(seed + rank)


def _shape(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else "x".join(map(str, shape)) or "scalar"


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


class Trainer:
    def __init__(self, cfg: RunConfig, comm: Comm, run_dir: Path, clock=None):
        # Count traffic per collective kind and (dist.check_collectives) check every call's header.
        comm = comm.instrumented(check=cfg.dist.check_collectives)
        self.cfg, self.comm, self.run_dir = cfg, comm, Path(run_dir)
        self.mesh = build_mesh(comm, cfg.dist.tp)   # its dp / tp groups: comm's check, their own stats
        self.clock = clock or time.monotonic     # rank 0's clock decides checkpoint.every_minutes
        self.skipped_batches = 0                 # batches skipped after rollbacks (guard.skip_batches)
        # Tensor-parallel ranks of one data-parallel group draw the same dropout masks.
        seed_process_rngs(cfg.seed, self.mesh.dp.rank)
        self.ckpt_root = self.run_dir / cfg.checkpoint.dir
        plan = BatchPlan(cfg.global_batch, self.mesh.dp.size, cfg.train.grad_accum)
        self.data, self.heldout = data.build(cfg, comm, plan)
        self.model, self.optimizer = self.build(seed=cfg.seed)
        self.faults = Faults(cfg.fault, comm.rank)
        if cfg.fault.perturb_param is not None:
            self.faults.perturbed_slot(self.optimizer.layout.slots)   # a bad name fails now, not at the step

    def say(self, message: str) -> None:
        """One line on rank 0's stdout (every rank knows the same facts; one speaks)."""
        if self.comm.rank == 0:
            print(message, flush=True)

    def build(self, seed: int) -> tuple[MiniGPT, ZeroOptimizer]:
        model = build_model(self.cfg.model, seed)
        broadcast_module_(model, self.comm)
        self.tp_splits = shard_model_(model, self.mesh.tp)     # parameter name -> Split (none at tp=1)
        optimizer = make_optimizer(model, self.mesh.dp, self.cfg.zero.stage, self.cfg.optimizer.adamw,
                                   self.cfg.optimizer.grad_clip, tp=self.mesh.tp, tp_split=self.tp_splits,
                                   param_dtype=self.cfg.param_dtype, bucket_numel=self.cfg.zero.bucket_numel)
        return model, optimizer

    # -- checkpoints ----------------------------------------------------------
    def _state(self, step: int, optimizer: ZeroOptimizer, skipped: int | None = None) -> tuple[dict, dict]:
        skipped = self.skipped_batches if skipped is None else skipped
        rng_tensors, rng_meta = checkpoint.capture_rng()
        tensors = {**optimizer.state_shard(), **rng_tensors}
        rank_state = {"step": step, "optimizer_steps": optimizer.step_count,
                      "data": self.data.position(step + skipped), "rng": rng_meta}
        if skipped:
            rank_state["skipped_batches"] = skipped
        return tensors, rank_state

    def save(self, step: int) -> tuple[dict, dict, dict]:
        tensors, rank_state = self._state(step, self.optimizer)
        meta = {"zero_stage": self.cfg.zero.stage, "seed": self.cfg.seed,
                "model": dataclasses.asdict(self.cfg.model), "data": self.data.position(step + self.skipped_batches),
                "data_config": dataclasses.asdict(self.cfg.data), "layout": self.optimizer.layout.to_dict(),
                **self._parallel_meta()}
        if self.skipped_batches:     # guard.skip_batches: part of the data position (docs/unattended.md)
            meta["skipped_batches"] = self.skipped_batches
        path = checkpoint.save(self.ckpt_root, step, tensors, rank_state, meta, self.comm,
                               self.faults.save_hook(step))
        return tensors, rank_state, checkpoint.read_manifest(path)

    def prune(self) -> None:
        """checkpoint.keep_last: rank 0 deletes all but the newest K committed checkpoints, and every
        rank forgets them as rollback targets. With the guard on it runs when a checkpoint becomes
        trusted (and at the end), so the newest trusted rollback target is never deleted."""
        if not self.cfg.checkpoint.keep_last:
            return
        removed = []
        if self.comm.rank == 0:
            try:
                removed = [str(p) for p in checkpoint.prune(self.ckpt_root, self.cfg.checkpoint.keep_last)]
                for old in removed:
                    print(f"checkpoint: removed {old} (checkpoint.keep_last={self.cfg.checkpoint.keep_last})")
            except OSError as exc:  # training can go on; the operator must hear about it
                print(f"warning: checkpoint.keep_last could not remove an old checkpoint: {exc}", file=sys.stderr)
        self.targets.forget(json.loads(agree.gather_bytes(json.dumps(removed).encode(), self.comm)[0]))

    def load(self, path: Path, model: MiniGPT, optimizer: ZeroOptimizer, verified: bool = False) -> int:
        """Verify ``path`` (the ranks hash its files between them and share the verdict), check it fits,
        then restore this rank's optimizer partition (resharded if the checkpoint's world size
        differs), parameters, RNG and data position. Nothing is loaded unless all of it fits."""
        path = Path(path)
        if not verified:
            checkpoint.verify_collectively(path, self.comm)
        manifest = agree.agreed(lambda: checkpoint.read_manifest(path), self.comm, checkpoint.CheckpointError)
        self._check_compatible(path, manifest, optimizer.layout)
        state, rank_state, rng = agree.agreed(
            lambda: reshard.load_partition(path, manifest, self.mesh.dp.rank, self.mesh.dp.size, self.mesh.tp.rank),
            self.comm, checkpoint.CheckpointError)
        optimizer.load_state_shard(state, rank_state["optimizer_steps"])
        if rng is not None:
            checkpoint.restore_rng(rng, rank_state["rng"])
        else:
            seed_process_rngs(self.cfg.seed, self.mesh.dp.rank)
        if optimizer is self.optimizer:
            self.skipped_batches = int(manifest.get("skipped_batches", 0))
        reseeded = [r for r, (had,) in enumerate(agree.gather([float(rng is not None)], self.comm)) if not had]
        if manifest["world_size"] != self.comm.size:
            self.say(f"resharded checkpoint {path}: saved by {manifest['world_size']} rank(s) at ZeRO stage "
                     f"{manifest.get('zero_stage')}, loaded into {self.comm.size} at stage {self.cfg.zero.stage}; "
                     f"the data position carries over (same global batch, {self.cfg.global_batch})")
        if reseeded:
            self.say(f"rank(s) {reseeded} have no saved RNG state in {path} (it was saved by fewer ranks): "
                     f"re-seeded from seed + rank; dropout draws differ from the original run")
        return int(manifest["step"])

    def _parallel_meta(self) -> dict:
        """The mesh, and with tensor parallelism each TP rank's flat layout with how every local
        parameter maps to the full one (split dim, groups, index), so the shards can be reassembled."""
        tp = self.mesh.tp.size
        meta = {"tp": tp, "dp": self.mesh.dp.size, "rank_order": "global rank = dp_rank * tp + tp_rank",
                "param_dtype": self.cfg.train.dtype}
        if tp > 1:
            meta["tp_layouts"] = manifest_layouts(self.optimizer.layout.to_dict(), self.tp_splits)
        return meta

    def _check_compatible(self, path: Path, manifest: dict, layout: FlatLayout) -> None:
        """Refuse, listing every difference, a checkpoint whose parameters or data stream differ."""
        problems = []
        if manifest.get("tp", 1) != self.mesh.tp.size:
            raise checkpoint.CheckpointError(
                f"checkpoint {path} does not fit this run, nothing was loaded: saved with dist.tp="
                f"{manifest.get('tp', 1)}, this run has dist.tp={self.mesh.tp.size} (resharding across "
                f"tensor-parallel degrees is not supported)")
        saved = FlatLayout.from_dict(manifest.get("tp_layouts", [manifest["layout"]])[self.mesh.tp.rank])
        if saved.slots != layout.slots:
            model = dataclasses.asdict(self.cfg.model)
            for key, value in manifest.get("model", {}).items():
                if model.get(key) != value:
                    problems.append(f"model.{key}: checkpoint {value}, this run {model.get(key)}")
            ours = {s.name: s.shape for s in layout.slots}
            theirs = {s.name: s.shape for s in saved.slots}
            shapes = [f"parameter {name}: checkpoint {_shape(theirs.get(name))}, model {_shape(ours.get(name))}"
                      for name in [s.name for s in saved.slots] + [n for n in ours if n not in theirs]
                      if ours.get(name) != theirs.get(name)]
            problems += shapes or ["same parameters and shapes, but a different order in the flat layout"]
        data_config = dataclasses.asdict(self.cfg.data)
        for key, value in manifest.get("data_config", {}).items():
            # A text file is identified by its sha256 (the position's "source"), not by where it
            # or its token file lives, so a moved file still resumes and a changed one does not.
            if key not in ("path", "cache_dir") and data_config.get(key) != value:
                problems.append(f"data.{key}: checkpoint {value}, this run {data_config.get(key)} "
                                f"(a different corpus)")
        skipped = int(manifest.get("skipped_batches", 0))
        saved_position, position = manifest.get("data"), self.data.position(int(manifest["step"]) + skipped)
        if saved_position and saved_position != position:
            if saved_position["global_batch"] != position["global_batch"]:
                problems.append(
                    f"global batch: checkpoint {saved_position['global_batch']} sequences per step, this run "
                    f"{position['global_batch']}; the data order cannot continue exactly. Set "
                    f"train.global_batch={saved_position['global_batch']} (any world size that divides it)")
            if saved_position["seed"] != position["seed"]:
                problems.append(f"seed (data order): checkpoint {saved_position['seed']}, this run {position['seed']}")
            if saved_position.get("source") != position.get("source"):
                problems.append(f"data source: checkpoint {saved_position.get('source')}, this run "
                                f"{position.get('source')} (the text file's content changed)")
            if saved_position["num_windows"] != position["num_windows"]:
                problems.append(f"training windows in the corpus: checkpoint {saved_position['num_windows']}, "
                                f"this run {position['num_windows']}")
        if problems:
            raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this run, nothing was loaded:\n  "
                                             + "\n  ".join(problems))

    def resolve_resume(self) -> tuple[Path | None, bool]:
        """(checkpoint to resume from or None, whether it has been verified already). For "latest",
        the ranks verify the candidates together, newest first; damaged ones are moved aside."""
        resume = self.cfg.checkpoint.resume
        if resume not in (None, "", "none", "null") and resume != "latest":
            return Path(resume), False
        listing = json.dumps([str(p) for p in checkpoint.list_committed(self.ckpt_root)]) if self.comm.rank == 0 else ""
        candidates = [Path(p) for p in json.loads(agree.gather_bytes(listing.encode(), self.comm)[0])]
        if resume != "latest":
            if candidates:  # a fresh run here would collide with (and never overwrite) those checkpoints
                raise checkpoint.CheckpointError(
                    f"{self.ckpt_root} already holds checkpoint(s) up to {candidates[-1].name}; pass "
                    f"checkpoint.resume=latest to continue that run, or choose a new hydra.run.dir")
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
                    f"checkpoint.resume=latest: none of the {len(damaged)} checkpoint(s) in {self.ckpt_root} "
                    f"verifies; the newest: {damaged[0][1]}")
            self.say(f"resume: no checkpoint in {self.ckpt_root}; starting fresh")
            return None, False
        if self.comm.rank == 0:
            for bad, problem in damaged:
                # Moved aside, not deleted: kept for inspection, and the rerun can save that step again.
                print(f"resume: skipping a damaged checkpoint (moved to {checkpoint.quarantine(bad)}): {problem}",
                      file=sys.stderr, flush=True)
        self.say(f"resume: latest valid checkpoint is {path}")
        return path, True

    # -- the loop -------------------------------------------------------------
    def run(self) -> RunResult:
        cfg, comm = self.cfg, self.comm
        start = 0
        with watchdog.watch("startup (resume)", comm, cfg.dist.timeout_s):
            resume_path, verified = self.resolve_resume()
            if resume_path is not None:
                start = self.load(resume_path, self.model, self.optimizer, verified)
                self.say(f"resumed from {resume_path} at step {start}")
        result = RunResult(start_step=start, numel=self.optimizer.layout.numel)
        start_point = (None if not cfg.guard.enabled else RollbackPoint(start, resume_path) if resume_path
                       else RollbackPoint(start, None, self._state(start, self.optimizer)))
        self.targets = RollbackTargets(start_point)
        self.snapshot = None
        self.trips = 0
        self.clock_s = schedule.CheckpointClock(cfg.checkpoint.every_minutes, self.clock)
        tokens = cfg.global_batch * cfg.model.seq_len
        with schedule.StopSignals(deadline_s=cfg.dist.timeout_s) as signals, \
                MetricsLog(cfg.metrics, self.run_dir, comm, tokens, cfg.train.steps,
                           groups={"dp": self.mesh.dp, "tp": self.mesh.tp}) as log:
            self.log = log
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if resume_path is not None or attempt:
                log.event("restart", start, say=f"resumed from {resume_path} (launcher attempt {attempt})",
                          checkpoint=str(resume_path) if resume_path else None, attempt=attempt,
                          world_size=comm.size, steps=cfg.train.steps)
            else:
                log.event("run_start", start, world_size=comm.size, steps=cfg.train.steps)
            if cfg.guard.check_sync_every and not self.replicas_to_compare():
                self.say("guard.check_sync_every: at ZeRO stage 3 with dist.tp=1 no parameter is held by two "
                         "ranks, so the replica check has nothing to compare and does not run")
            step = start + 1
            try:
                while step <= cfg.train.steps:
                    with watchdog.watch(f"step {step}", comm, cfg.dist.timeout_s):
                        step = self._step(step, result, signals)
                    if result.stopped_by:
                        break
            except Exception as exc:
                if not isinstance(exc, (guard.GuardError, guard.DesyncError)):   # those logged their own
                    log.event("error", step, error=type(exc).__name__, message=str(exc))
                raise
            last = result.steps[-1].step if result.steps else start
            with watchdog.watch("end of run", comm, cfg.dist.timeout_s):
                if self.targets.pending is not None:
                    self.prune()            # the last checkpoint is as trusted as it will get
                result.memory = self.memory_report()
                log.final_memory(last, self.optimizer.memory_bytes())
                if self.snapshot is not None and cfg.checkpoint.verify_resume and not result.stopped_by:
                    result.resume_check = self.verify_resume(*self.snapshot)
            log.event("run_end", last, status="stopped by " + result.stopped_by if result.stopped_by else "completed",
                      rollbacks=len(result.rollbacks))
        return result

    def _step(self, step: int, result: RunResult, signals: schedule.StopSignals) -> int:
        """Run ``step``; return the next step to run (smaller than step + 1 after a rollback)."""
        cfg, comm, faults = self.cfg, self.comm, self.faults
        faults.hang(step)
        began = time.perf_counter()
        self.log.begin_step()
        self.model.train()
        local_loss = 0.0
        for inputs, targets in self.data.micro_batches(step - 1 + self.skipped_batches, self.mesh.dp.rank):
            loss = self.model(inputs, targets) / cfg.train.grad_accum
            loss.backward()
            local_loss += float(loss.detach())
        # Stages 0/1: the local gradients; 2/3: this rank's partition, reduced during backward.
        faults.poison_grads(step, self.optimizer.grad_buffer)
        faults.sigterm(step)
        grad_norm = self.optimizer.sync_grads()      # over the data- and tensor-parallel groups
        recent = [s.loss for s in result.steps[-cfg.guard.spike_window:]]
        # The loss is the mean over one data-parallel group (TP ranks of a group share a loss);
        # every rank's loss and norm take part in the verdict.
        verdict = guard.check_step(local_loss, grad_norm, recent, cfg.guard, comm, loss_ranks=self.mesh.dp.ranks)
        if not verdict.ok:
            self.optimizer.zero_grad()
            return self._roll_back(step, verdict, grad_norm, result)
        if self.targets.step_passed():
            self.prune()
        lr = cfg.optimizer.adamw.lr * faults.lr_factor(step)
        self.optimizer.apply_update(lr)
        self.optimizer.zero_grad()
        faults.perturb(step, self.optimizer.param_buffer, self.optimizer.layout.slots,
                       start=self.optimizer.param_buffer_start)
        norms = [row[0] for row in agree.gather([self.optimizer.param_norm()], comm)]
        seconds = time.perf_counter() - began
        signals.deadline_s = max(signals.deadline_s, cfg.dist.timeout_s + 2 * seconds)
        val_loss = self.evaluate() if cfg.train.eval_every and step % cfg.train.eval_every == 0 else None
        result.steps.append(StepLog(step, verdict.loss, grad_norm, norms, seconds, val_loss))
        self.log.step(step, loss=verdict.loss, local_loss=local_loss, grad_norm=grad_norm, param_norm=norms[0],
                      lr=lr, seconds=seconds, memory=self.optimizer.memory_bytes(), val_loss=val_loss)
        if cfg.guard.check_sync_every and step % cfg.guard.check_sync_every == 0:
            try:
                self.check_replicas(step)
            except guard.DesyncError as exc:
                self.log.event("desync", step, say=str(exc), message=str(exc))
                raise
        decision = schedule.decide(step, cfg.checkpoint.every_steps, self.clock_s, signals, comm)
        if decision.stop:
            signals.acknowledge()          # every rank reached the boundary; the save has no deadline
        if decision.save:
            self._save(step, decision.save, result)
        if decision.stop:
            result.stopped_by = decision.stop
            self.log.event("preempted", step, say=f"{decision.stop} received: checkpoint saved, stopping",
                           signal=decision.stop)
        faults.after_step(step)
        return step + 1

    def replicas_to_compare(self) -> bool:
        """Whether any parameter bytes are held by more than one rank. At ZeRO stage 3 a data-parallel
        group holds one copy of its parameters, split in partitions; only with tensor parallelism are
        some (the non-split ones) replicated, across the tensor-parallel ranks."""
        return self.cfg.zero.stage != 3 or self.mesh.tp.size > 1

    def check_replicas(self, step: int) -> None:
        """guard.check_replicas on what must be identical: every parameter within its data-parallel
        group (ranks with the same tensor-parallel shard) and the non-split ones across all ranks.
        At stage 3 the parameters are gathered first (collective over the data-parallel group), so
        the comparison is of the non-split parameters across tensor-parallel ranks."""
        if not self.replicas_to_compare():
            return
        opt = self.optimizer
        guard.check_replicas(opt.full_params(), opt.layout.slots, step, self.comm,
                             tp=self.mesh.tp.size, split=set(self.tp_splits))

    def _save(self, step: int, reason: str, result: RunResult) -> None:
        began = time.perf_counter()
        tensors, rank_state, manifest = self.save(step)
        path = self.ckpt_root / checkpoint.step_dir_name(step)
        self.clock_s.saved()
        result.manifests.append(manifest)
        # With keep_last the first checkpoint may be pruned; the newest never is.
        if self.snapshot is None or self.cfg.checkpoint.keep_last:
            self.snapshot = (step, tensors, rank_state, self.optimizer.params_snapshot())
        self.targets.saved_checkpoint(step, path)
        if not self.cfg.guard.enabled:
            self.prune()
        nbytes, seconds = sum(f["bytes"] for f in manifest["files"]), time.perf_counter() - began
        self.log.event("checkpoint_saved", step, say=f"{path} ({nbytes} bytes, {seconds:.2f} s, {reason})",
                       path=str(path), reason=reason, bytes=nbytes, seconds=seconds)

    def _roll_back(self, step: int, verdict: guard.Verdict, grad_norm: float, result: RunResult) -> int:
        """The guard tripped at ``step``: restore the newest trusted state and return the step to run next."""
        cfg = self.cfg
        self.trips += 1
        detail = dict(reason=verdict.trip, loss=json_number(verdict.loss), grad_norm=json_number(grad_norm))
        if self.trips > cfg.guard.max_rollbacks:
            message = (f"guard tripped at step {step} ({verdict.trip}); that is trip {self.trips}, more than "
                       f"guard.max_rollbacks={cfg.guard.max_rollbacks}: stopping instead of rolling back again")
            self.log.event("guard_stop", step, say=message, **detail)
            raise guard.GuardError(message)
        distrusted, errors = self.targets.pending, []
        for target in self.targets.candidates():
            try:
                self._restore(target)
                break
            except checkpoint.CheckpointError as exc:     # same verdict on every rank (load agrees on it)
                errors.append(str(exc))
        else:
            raise guard.GuardError(f"guard tripped at step {step} ({verdict.trip}) but no state to roll back to: "
                                   + ("; ".join(errors) or "the guard keeps no rollback target"))
        set_aside = self.targets.rolled_back_to(target, self.trips, self.ckpt_root, self.comm)
        self.skipped_batches += cfg.guard.skip_batches
        result.steps = [s for s in result.steps if s.step <= target.step]
        result.manifests = [m for m in result.manifests if m["step"] <= target.step]
        if self.snapshot is not None and self.snapshot[0] > target.step:
            self.snapshot = None
        source = target.describe()
        event = dict(step=step, to_step=target.step, source=source, set_aside=set_aside,
                     distrusted=str(distrusted.path) if distrusted else None, skipped_batches=self.skipped_batches,
                     rollback=self.trips, max_rollbacks=cfg.guard.max_rollbacks, failed_targets=errors, **detail)
        result.rollbacks.append(event)
        self.log.event("rollback", step, say=f"{verdict.trip}; no update applied, rolled back to step "
                       f"{target.step} ({source}), rollback {self.trips} of at most {cfg.guard.max_rollbacks}"
                       + (f", skipping {cfg.guard.skip_batches} batch(es)" if cfg.guard.skip_batches else ""),
                       **{k: v for k, v in event.items() if k != "step"})
        return target.step + 1

    def _restore(self, point: RollbackPoint) -> None:
        if point.path is not None:
            self.load(point.path, self.model, self.optimizer)
            return
        tensors, rank_state = point.state
        self.optimizer.load_state_shard(tensors, rank_state["optimizer_steps"])
        checkpoint.restore_rng(tensors, rank_state["rng"])
        self.skipped_batches = rank_state.get("skipped_batches", 0)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean per-token loss over the held-out windows: each data-parallel rank scores its share
        (the tensor-parallel ranks of a group score it together), the (sum, count) pairs are
        combined in rank order, so every rank gets the same value."""
        dp = self.mesh.dp
        batches = self.heldout.batches(dp.rank, dp.size, self.data.plan.micro_batch)
        # With ZeRO-3 or tensor parallelism every forward is collective: all ranks run as many
        # as the busiest one (the extra ones score nothing).
        forwards = int(max(row[0] for row in agree.gather([float(len(batches))], dp)))
        idle = torch.zeros(1, self.cfg.model.seq_len, dtype=torch.int64)
        self.model.eval()
        total, count = 0.0, 0
        try:
            for i in range(forwards):
                inputs, targets = batches[i] if i < len(batches) else (idle, idle)
                loss = float(self.model(inputs, targets))
                if i < len(batches):
                    total += loss * targets.numel()
                    count += targets.numel()
        finally:
            self.model.train()
        rows = agree.gather([total, float(count)], dp)
        return sum(row[0] for row in rows) / sum(row[1] for row in rows)

    def memory_report(self) -> list[dict]:
        measured = self.optimizer.memory_bytes()
        keys = sorted(measured)
        rows = agree.gather([float(measured[k]) for k in keys], self.comm)
        formula = self.optimizer.memory_formula()
        expected, allowance = ({k: v[i] for k, v in formula.items()} for i in (0, 1))
        text = {k: v[2] for k, v in formula.items()}
        return [{"rank": r, "measured": dict(zip(keys, map(int, row))), "expected": expected,
                 "allowance": allowance, "formula": text} for r, row in enumerate(rows)]

    def verify_resume(self, step: int, tensors: dict, rank_state: dict, params: torch.Tensor) -> ResumeCheck:
        """Reload the checkpoint of ``step`` into a freshly built model and optimizer (initialised
        from a different seed) and compare every restored byte with the snapshot taken at save."""
        model, optimizer = self.build(seed=self.cfg.seed + 1)
        loaded_step = self.load(self.ckpt_root / checkpoint.step_dir_name(step), model, optimizer)
        restored_tensors, restored_state = self._state(loaded_step, optimizer, rank_state.get("skipped_batches", 0))
        mismatches = []
        for key in sorted(tensors):
            if _bytes(tensors[key]) != _bytes(restored_tensors[key]):
                mismatches.append(f"{key} differs")
        if _bytes(params) != _bytes(optimizer.params_snapshot()):
            mismatches.append("model parameters differ")
        if rank_state != json.loads(json.dumps(restored_state)):
            mismatches.append("step, data position or python/numpy RNG differ")
        reports = agree.gather_bytes(json.dumps(mismatches).encode(), self.comm)
        every = [f"rank {r}: {m}" for r, rep in enumerate(reports) for m in json.loads(rep)]
        return ResumeCheck(step, every)
