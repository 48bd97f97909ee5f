"""The training loop: forward, backward, one ZeRO step, logging, checkpoints.

It composes narrow APIs in order and knows nothing about how they talk:
``DataParallel`` (initial broadcast), ``ZeroOptimizer.sync_grads/apply_update``
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
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from distlib import agree, checkpoint, guard, schedule, watchdog
from distlib.comm import Comm
from distlib.config import RunConfig
from distlib.data import BatchPlan, GlobalBatches, make_corpus
from distlib.ddp import DataParallel
from distlib.fault import FaultInjector
from distlib.metrics import MetricsLog, json_number
from distlib.model import MiniGPT, build_model
from distlib.rollback import RollbackPoint, RollbackTargets
from distlib.zero import FlatLayout, ZeroOptimizer


@dataclass
class StepLog:
    step: int
    loss: float
    grad_norm: float
    param_norms: list[float]     # one per rank, after the update
    seconds: float


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


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


class Trainer:
    def __init__(self, cfg: RunConfig, comm: Comm, run_dir: Path, clock=None):
        # Count traffic per collective kind and (dist.check_collectives) check every call's header.
        comm = comm.instrumented(check=cfg.dist.check_collectives)
        self.cfg, self.comm, self.run_dir = cfg, comm, Path(run_dir)
        self.clock = clock or time.monotonic     # rank 0's clock decides checkpoint.every_minutes
        self.faults = FaultInjector(cfg.fault, comm.rank)
        self.skipped_batches = 0                 # batches skipped after rollbacks (guard.skip_batches)
        seed_process_rngs(cfg.seed, comm.rank)
        self.ckpt_root = self.run_dir / cfg.checkpoint.dir
        plan = BatchPlan(cfg.global_batch, comm.size, cfg.train.grad_accum)
        corpus = make_corpus(cfg.data.seed, cfg.data.total_tokens, cfg.model.vocab_size, cfg.data.follow_prob)
        self.data = GlobalBatches(corpus, cfg.model.seq_len, plan, cfg.seed)
        self.model, self.optimizer = self.build(seed=cfg.seed)
        if cfg.fault.perturb_param is not None:
            self.faults.perturbed_slot(self.optimizer.layout.slots)   # a bad name fails now, not at the step

    def build(self, seed: int) -> tuple[MiniGPT, ZeroOptimizer]:
        model = DataParallel(build_model(self.cfg.model, seed), self.comm).module
        optimizer = ZeroOptimizer(model, self.comm, self.cfg.zero.stage, self.cfg.optimizer.adamw,
                                  self.cfg.optimizer.grad_clip)
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
                "model": dataclasses.asdict(self.cfg.model), "layout": self.optimizer.layout.to_dict()}
        path = checkpoint.save(self.ckpt_root, step, tensors, rank_state, meta, self.comm)
        return tensors, rank_state, checkpoint.read_manifest(path)

    def load(self, path: Path, model: MiniGPT, optimizer: ZeroOptimizer) -> int:
        """Verify ``path`` (rank 0 hashes every file, all ranks hear the verdict), then restore
        this rank's optimizer partition, parameters, RNG and data position. Returns the step."""
        error = ""
        if self.comm.rank == 0:
            try:
                checkpoint.verify(path)
            except checkpoint.CheckpointError as exc:
                error = str(exc)
        errors = [b.decode() for b in agree.gather_bytes(error.encode(), self.comm)]
        if errors[0]:
            raise checkpoint.CheckpointError(errors[0])
        manifest = checkpoint.read_manifest(path)
        self._check_compatible(path, manifest, optimizer.layout)
        tensors, rank_state = checkpoint.load_shard(path, self.comm.rank)
        skipped = rank_state.get("skipped_batches", 0)
        expected_position = self.data.position(manifest["step"] + skipped)
        if rank_state["data"] != expected_position:
            raise checkpoint.CheckpointError(
                f"checkpoint {path}: data position {rank_state['data']} cannot continue with this "
                f"configuration's {expected_position} (seed or global batch differ)")
        optimizer.load_state_shard(tensors, rank_state["optimizer_steps"])
        checkpoint.restore_rng(tensors, rank_state["rng"])
        if optimizer is self.optimizer:
            self.skipped_batches = skipped
        return int(manifest["step"])

    def _check_compatible(self, path: Path, manifest: dict, layout: FlatLayout) -> None:
        problems = []
        if manifest["world_size"] != self.comm.size:
            problems.append(f"saved with world size {manifest['world_size']}, this run has {self.comm.size}")
        saved = FlatLayout.from_dict(manifest["layout"])
        if saved.slots != layout.slots:
            ours = {s.name: s.shape for s in layout.slots}
            theirs = {s.name: s.shape for s in saved.slots}
            for name in sorted(set(ours) | set(theirs)):
                if ours.get(name) != theirs.get(name):
                    problems.append(f"{name}: checkpoint {theirs.get(name)}, model {ours.get(name)}")
            if not problems:
                problems.append("parameter order or offsets differ")
        if problems:
            raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this run: " + "; ".join(problems))

    def resolve_resume(self) -> Path | None:
        resume = self.cfg.checkpoint.resume
        if resume in (None, "", "none", "null"):
            return None
        if resume == "latest":
            found = checkpoint.list_committed(self.ckpt_root)
            return found[-1] if found else None
        return Path(resume)

    # -- the loop -------------------------------------------------------------
    def run(self) -> RunResult:
        cfg, comm = self.cfg, self.comm
        start = 0
        with watchdog.watch("startup (resume)", comm, cfg.dist.timeout_s):
            resume_path = self.resolve_resume()
            if resume_path is not None:
                start = self.load(resume_path, self.model, self.optimizer)
        result = RunResult(start_step=start, numel=self.optimizer.layout.numel)
        start_point = (None if not cfg.guard.enabled else RollbackPoint(start, resume_path) if resume_path
                       else RollbackPoint(start, None, self._state(start, self.optimizer)))
        self.targets = RollbackTargets(start_point)
        self.snapshot = None
        self.trips = 0
        self.clock_s = schedule.CheckpointClock(cfg.checkpoint.every_minutes, self.clock)
        tokens = cfg.global_batch * cfg.model.seq_len
        with schedule.StopSignals(deadline_s=cfg.dist.timeout_s) as signals, \
                MetricsLog(cfg.metrics, self.run_dir, comm, tokens, cfg.train.steps) as log:
            self.log = log
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if resume_path is not None or attempt:
                log.event("restart", start, say=f"resumed from {resume_path} (launcher attempt {attempt})",
                          checkpoint=str(resume_path) if resume_path else None, attempt=attempt,
                          world_size=comm.size, steps=cfg.train.steps)
            else:
                log.event("run_start", start, world_size=comm.size, steps=cfg.train.steps)
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
        for inputs, targets in self.data.micro_batches(step - 1 + self.skipped_batches, comm.rank):
            loss = self.model(inputs, targets) / cfg.train.grad_accum
            loss.backward()
            local_loss += float(loss.detach())
        faults.poison_grads(step, self.optimizer.flat_grads)
        faults.sigterm(step)
        grad_norm = self.optimizer.sync_grads()
        recent = [s.loss for s in result.steps[-cfg.guard.spike_window:]]
        verdict = guard.check_step(local_loss, grad_norm, recent, cfg.guard, comm)
        if not verdict.ok:
            self.optimizer.zero_grad()
            return self._roll_back(step, verdict, grad_norm, result)
        self.targets.step_passed()
        lr = cfg.optimizer.adamw.lr * faults.lr_factor(step)
        self.optimizer.apply_update(lr)
        self.optimizer.zero_grad()
        faults.perturb(step, self.optimizer.flat_params, self.optimizer.layout.slots)
        norms = [row[0] for row in agree.gather([self.optimizer.param_norm()], comm)]
        seconds = time.perf_counter() - began
        signals.deadline_s = max(signals.deadline_s, cfg.dist.timeout_s + 2 * seconds)
        result.steps.append(StepLog(step, verdict.loss, grad_norm, norms, seconds))
        self.log.step(step, loss=verdict.loss, local_loss=local_loss, grad_norm=grad_norm, param_norm=norms[0],
                      lr=lr, seconds=seconds, memory=self.optimizer.memory_bytes())
        if cfg.guard.check_sync_every and step % cfg.guard.check_sync_every == 0:
            try:
                guard.check_replicas(self.optimizer.flat_params, self.optimizer.layout.slots, step, comm)
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
        return step + 1

    def _save(self, step: int, reason: str, result: RunResult) -> None:
        began = time.perf_counter()
        tensors, rank_state, manifest = self.save(step)
        path = self.ckpt_root / checkpoint.step_dir_name(step)
        self.clock_s.saved()
        result.manifests.append(manifest)
        if self.snapshot is None:
            self.snapshot = (step, tensors, rank_state, self.optimizer.flat_params.clone())
        self.targets.saved_checkpoint(step, path)
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

    def memory_report(self) -> list[dict]:
        measured = self.optimizer.memory_bytes()
        keys = sorted(measured)
        rows = agree.gather([float(measured[k]) for k in keys], self.comm)
        expected, allowance = self.optimizer.expected_bytes(), self.optimizer.padding_allowance_bytes()
        return [{"rank": r, "measured": dict(zip(keys, map(int, row))), "expected": expected,
                 "allowance": allowance} for r, row in enumerate(rows)]

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
        if _bytes(params) != _bytes(optimizer.flat_params):
            mismatches.append("model parameters differ")
        if rank_state != json.loads(json.dumps(restored_state)):
            mismatches.append("step, data position or python/numpy RNG differ")
        reports = agree.gather_bytes(json.dumps(mismatches).encode(), self.comm)
        every = [f"rank {r}: {m}" for r, rep in enumerate(reports) for m in json.loads(rep)]
        return ResumeCheck(step, every)
