"""The training loop, read as the composition it is.

Built once (``__init__``): the model of ``model.family`` (``families.build``), broadcast from rank 0
(``broadcast_module_``) and its Linear layers swapped for tensor-parallel ones
(``families.shard_model_``), its ``ZeroOptimizer``, the data (``GlobalBatches``: which batch a
step reads), the ``Checkpointer`` (every checkpoint decision; a fresh start from
``model.init_from``'s weights), the guard's ``Rollback`` and ``ReplicaCheck``, and the
``StepHooks`` attached from outside (fault injection: distlib/app/runtime/faults.py; no-ops by default).
Then one step::

    hooks.before_step
    batches -> forward / backward          data.step_batches (past skipped batches), through the step
                                           program: LocalStep, or PipelineStep at dist.pp > 1
    hooks.after_backward
    optimizer.sync_grads                   gradient sync -> global grad norm
    guard.check_step                       the collective verdict; a trip rolls back instead
    optimizer.apply_update                 (lr_at(step) x hooks.lr_factor), then hooks.after_update
    the step's values                      one gather: parameter norms, metrics row, save/stop votes
    memory snapshot, log                   the snapshot round (every K steps), then the metrics record;
                                           every guard.check_sync_every steps the replica check
    maybe save / stop                      stopping.decision (from the votes) -> checkpointer.boundary
    hooks.after_step

Every step runs inside ``watchdog.watch``, which turns a timed-out collective into an error
naming the step and the ranks that did not arrive. ``agree`` carries the few values ranks must
share. docs/unattended.md has the step in more detail.

``device`` ("cpu" or "cuda:<k>", ``RunConfig.device``) is where the model, its optimizer's buffers
and the batches live; the model is built on the CPU (the same initial weights on every device)
and moved there. A step reads back from the device only what it logs and decides on: the grad
norm, then the loss (summed on the device over the micro-batches; by then the norm's read has
waited for the device), and the parameter norm after the update.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from distlib.app.checkpointing.checkpointer import Checkpointer, RunState
from distlib.app.checkpointing.rng import seed_process_rngs
from distlib.app.config.lr_schedule import lr_at
from distlib.app.config.run import RunConfig
from distlib.app.data import corpus as data
from distlib.app.data.batches import BatchPlan
from distlib.app.model import families
from distlib.app.model.bias_balance import state_buffers
from distlib.app.model.layers import CausalLM
from distlib.app.model.local_step import LocalStep
from distlib.app.model.pipeline_step import PipelineStep
from distlib.app.model.routing_count import RoutingCount
from distlib.app.observe import throughput
from distlib.app.observe.live_bytes import StepMeter
from distlib.app.observe.memory import memory_report
from distlib.app.observe.metrics import MetricsLog
from distlib.app.observe.profiling import StepProfiler
from distlib.app.observe.results import RunResult, StepLog
from distlib.app.observe.validation import Validation
from distlib.app.rank_build import build
from distlib.app.runtime import launcher_env
from distlib.app.runtime.hooks import StepHooks
from distlib.app.unattended import guard, stopping
from distlib.app.unattended.rollback import Rollback
from distlib.comm import agree, local, watchdog
from distlib.comm.group import Comm
from distlib.comm.mesh import build_mesh
from distlib.parallel.dropout import Draws
from distlib.parallel.zero import ZeroOptimizer


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        comm: Comm,
        run_dir: Path,
        clock=None,
        hooks: StepHooks | None = None,
        device: str = "cpu",
    ):
        # Count traffic per collective kind, (dist.check_collectives) check every call's header, and
        # run dist.collectives' implementation (the mesh's groups inherit the last two).
        comm = comm.instrumented(check=cfg.dist.check_collectives, collectives=cfg.dist.collectives)
        d = cfg.dist
        hosts = None
        # the ranks of one host share a segment per group (messages on the CPU: gloo's, not NCCL's)
        if d.transport == "shm" and comm.transport is None and comm.device == "cpu":
            hosts = local.host_keys(comm)
            comm = local.attach(comm, hosts, d.timeout_s)
        self.cfg, self.comm, self.run_dir, self.device = cfg, comm, Path(run_dir), torch.device(device)
        self.mesh = mesh = build_mesh(comm, cfg.layout_of(comm.size), d.timeout_s, hosts)
        self.hooks = hooks = hooks if hooks is not None else StepHooks()
        # Whatever draws from the process RNGs draws per data-parallel rank; dropout does not: its
        # masks are keyed by the seed, the global sample and the site, for any layout.
        seed_process_rngs(cfg.seed, mesh.dp.rank)
        self.draws = Draws(cfg.seed, (), share=(mesh.tp.rank, mesh.tp.size))
        plan = BatchPlan(cfg.global_batch, mesh.dp.size, cfg.train.grad_accum)
        self.data, heldout = data.build(cfg, comm, plan, self.run_dir)  # run_dir: a BPE run's tokenizer
        self.meter = StepMeter(self.device, cfg.metrics.step_peak)  # every tensor alive, from the build on
        model, optimizer, chunks, splits, names = build(cfg, comm, mesh, self.device, cfg.seed, self.meter)
        self.model, self.optimizer = model, optimizer
        # the step program: every micro-batch through the whole model, or this stage's schedule
        if chunks:
            self.program = PipelineStep(cfg, mesh, model, chunks, self.device)
        else:
            self.program = LocalStep(model, cfg.train.grad_accum, self.device)
        # mixtral over micro-batches or stages: each step's routing is counted before its forwards;
        # with model.balance=bias the step's own forwards count and the biases move after the update
        # (otherwise a counter that counts nothing)
        self.routing = RoutingCount.for_run(cfg, model, mesh, self.program, self.device)
        # the state a run changes besides its parameters (model.balance=bias's expert biases), as
        # parts beside the parameters' for the hooks (views: the biases move in place)
        buffers = state_buffers(model)
        self.buffer_parts = guard.buffer_parts(buffers)
        hooks.check_model(names + list(buffers))  # (the stage's: another rank's expert too)
        # rank 0's clock decides checkpoint.every_minutes (the save/stop vote reads it)
        self.save_clock = stopping.CheckpointClock(cfg.checkpoint.every_minutes, clock or time.monotonic)
        state = RunState(model, optimizer, self.data, splits)
        self.checkpointer = Checkpointer(cfg, mesh, self.run_dir, state, hooks, self.save_clock)
        self.rollback = Rollback(cfg.guard, self.checkpointer, self.data, cfg.optimizer.lr)
        self.replicas = guard.ReplicaCheck(
            cfg.guard.check_sync_every, cfg.zero.stage, mesh, splits, optimizer, buffers
        )
        # the observers a step calls every time: each does nothing when its key is off
        every = cfg.train.eval_every  # 0: never due
        self.validation = Validation(
            every, heldout, model, mesh.dp, plan.micro_batch, self.device, self.data.ends
        )
        self.profiler = StepProfiler(cfg.train.profile_steps, self.run_dir, comm.rank)  # None: no window
        self.log: MetricsLog | None = None  # open while run() runs

    # -- the run ----------------------------------------------------------------
    def run(self) -> RunResult:
        cfg, comm = self.cfg, self.comm
        with watchdog.watch("startup (resume)", comm, cfg.dist.timeout_s):
            start, resume_path = self.checkpointer.resume()
        self.meter.begin(start)
        held = sum(p.layout.numel for p in self.optimizer.partitions())  # parameters on this rank
        result = RunResult(start_step=start, numel=held)
        tokens = cfg.global_batch * cfg.model.seq_len
        flops = 6 * families.active_param_count(cfg.model) * tokens  # per step, for MFU
        peak, self.peak_source = throughput.job_peak(
            comm, self.device, cfg.train.dtype, cfg.metrics.peak_flops
        )
        with (
            stopping.StopSignals(deadline_s=cfg.dist.timeout_s) as signals,
            MetricsLog(
                cfg.metrics,
                self.run_dir,
                comm,
                tokens,
                cfg.train.steps,
                groups=self.mesh.groups(),
                guard=cfg.guard,
                model_flops=flops,
                peak_flops=peak,
            ) as log,
        ):
            self.log = log
            self._log_start(start, resume_path)
            step = start + 1
            try:
                while step <= cfg.train.steps:
                    with watchdog.watch(f"step {step}", comm, cfg.dist.timeout_s):
                        step = self._step(step, result, signals)
                    if result.stopped_by:
                        break
            except Exception as exc:
                if not isinstance(exc, (guard.GuardError, guard.DesyncError)):  # those logged their own
                    log.event("error", step, error=type(exc).__name__, message=str(exc))
                raise
            finally:
                self.profiler.close()
            self._finish(start, result)
        return result

    def _log_start(self, start: int, resume_path: Path | None) -> None:
        cfg = self.cfg
        self.log.recover(self.checkpointer.recovered)  # the step resumed from, if its record was lost
        self.log.start_event(start, resume_path, launcher_env.attempt(), self.comm.size, cfg.train.steps)
        self.log.peak_event(start, self.peak_source)
        if cfg.guard.check_sync_every and not self.replicas.possible:
            self.checkpointer.say(f"guard.check_sync_every: {self.replicas.why_not}, so it does not run")

    def _finish(self, start: int, result: RunResult) -> None:
        last = result.steps[-1].step if result.steps else start
        with watchdog.watch("end of run", self.comm, self.cfg.dist.timeout_s):
            result.manifests += [saved.manifest for saved in self.checkpointer.finish(last, self.log)]
            result.memory = memory_report(self.memory_bytes(), self.optimizer.memory_formula(), self.comm)
            self.log.final_memory(last, self.memory_bytes())
            if not result.stopped_by:
                result.resume_check = self.checkpointer.verify_resume(self._fresh_model)
        self.log.event(
            "run_end",
            last,
            status="stopped by " + result.stopped_by if result.stopped_by else "completed",
            rollbacks=len(result.rollbacks),
        )

    # -- one step ---------------------------------------------------------------
    def _step(self, step: int, result: RunResult, signals: stopping.StopSignals) -> int:
        """Run ``step``; return the next step to run (smaller than step + 1 after a rollback)."""
        self.profiler.begin(step)
        self.hooks.before_step(step)
        began = time.perf_counter()
        self.log.begin_step()
        with self.meter.watch(step):  # metrics.step_peak: every tensor from the batches to the update
            summed = self._forward_backward(step)  # on the device, still being computed
            self.hooks.after_backward(step, self.optimizer.grad_buffer)
            grad_norm = self.optimizer.sync_grads()  # over the data- and tensor-parallel groups
            local_loss = float(summed)  # reading the norm already waited for the device
            recent = [s.loss for s in result.steps[-self.cfg.guard.spike_window :]]
            # The loss is the mean over one data-parallel group (TP ranks of a group share a loss);
            # every rank's loss and norm take part in the verdict.
            verdict = guard.check_step(
                local_loss, grad_norm, recent, self.cfg.guard, self.comm, loss_ranks=self.mesh.loss_ranks
            )
            if verdict.ok:
                self.checkpointer.step_passed()
                lr = self._apply_update(step)
        if not verdict.ok:
            return self._roll_back(step, verdict, grad_norm, result)
        seconds = time.perf_counter() - began
        signals.deadline_s = max(signals.deadline_s, self.cfg.dist.timeout_s + 2 * seconds)
        val_loss = self.validation.loss() if self.validation.due(step) else None
        memory = self.memory_bytes()
        norms, rows, votes = self._gather_step_values(seconds, memory, signals)
        record = self.log.step(
            step,
            loss=verdict.loss,
            local_loss=local_loss,
            grad_norm=grad_norm,
            param_norm=norms[0],
            lr=lr,
            seconds=seconds,
            memory=memory,
            val_loss=val_loss,
            rows=rows,
            # mixtral: its MoE; a data.mixture: the samples per source (and validation per source)
            model_fields=self.model.step_fields(self.cfg.train.grad_accum)
            | self.routing.fields()
            | self.data.step_fields(step)
            | self.validation.fields(),
            defer=True,
        )
        self.checkpointer.snapshot(step, record)  # first: a recorded step is in every snapshot
        self.log.emit(record)
        result.steps.append(StepLog(step, verdict.loss, grad_norm, norms, seconds, val_loss))
        if self.replicas.due(step):
            self.replicas.check(step, self.log)
        self._save_or_stop(
            step, result, signals, stopping.decision(step, self.cfg.checkpoint.every_steps, votes)
        )
        self.hooks.after_step(step)
        self.profiler.end(step)
        return step + 1

    def _forward_backward(self, step: int) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches; returns its (accumulated) loss, a
        float64 scalar on the device."""
        batches = self.data.held_batches(step, self.mesh.dp.rank, self.mesh.cp, self.device, self.draws)
        self.routing.count(batches)
        return self.program.run(batches)

    def _apply_update(self, step: int) -> float:
        """The update with this step's learning rate (returned), then the attached hooks see it."""
        # the schedule's rate is a function of the step: resumes continue it exactly
        lr = lr_at(step, self.cfg.optimizer, self.cfg.train.steps) * self.hooks.lr_factor(step)
        opt = self.optimizer
        opt.apply_update(lr)
        opt.zero_grad()
        self.routing.update()  # model.balance=bias: the experts' biases move
        self.hooks.after_update(step, opt.param_parts() + self.buffer_parts)
        return lr

    def _gather_step_values(
        self, seconds: float, memory: dict[str, int], signals: stopping.StopSignals
    ) -> tuple[list[float], list[list[float]], list[list[float]]]:
        """Every rank's parameter norm, metrics row and save/stop vote in one gather: (norms, rows, votes)."""
        vote = stopping.vote(self.save_clock, signals, self.comm, self.checkpointer.writing())
        norms, rows, votes = agree.gather_parts(
            [[self.optimizer.param_norm()], self.log.row(seconds, memory), vote], self.comm
        )
        return [row[0] for row in norms], rows, votes

    def _save_or_stop(
        self, step: int, result: RunResult, signals: stopping.StopSignals, decision: stopping.Decision
    ) -> None:
        if decision.stop:
            signals.acknowledge()  # every rank reached the boundary; the save has no deadline
        result.manifests += [saved.manifest for saved in self.checkpointer.boundary(step, decision, self.log)]
        if decision.stop:
            result.stopped_by = decision.stop
            self.log.event(
                "preempted",
                step,
                say=f"{decision.stop} received: checkpoint saved, stopping",
                signal=decision.stop,
            )

    def _roll_back(self, step: int, verdict: guard.Verdict, grad_norm: float, result: RunResult) -> int:
        """No update: restore the newest trusted state, forget what came after it; the step to run next."""
        self.optimizer.zero_grad()
        event = self.rollback.roll_back(step, verdict, grad_norm, self.log)
        result.rollbacks.append(event)
        result.steps = [s for s in result.steps if s.step <= event["to_step"]]
        result.manifests = [m for m in result.manifests if m["step"] <= event["to_step"]]
        return event["to_step"] + 1

    def _fresh_model(self) -> tuple[CausalLM, ZeroOptimizer]:
        """A model and optimizer like the run's, initialised from another seed (for the resume check)."""
        return build(self.cfg, self.comm, self.mesh, self.device, self.cfg.seed + 1)[:2]

    def memory_bytes(self) -> dict[str, int]:
        """The model states' peak bytes (the optimizer's accounting), the activations', the step's."""
        return {
            **self.optimizer.memory_bytes(),
            "activations": self.program.activation_peak,
            **self.meter.fields(),
        }
