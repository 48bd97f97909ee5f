"""Recovery drills: the failures the recovery paths exist for, injected on demand (``fault.*``).

Everything about faults is in this module: the ``fault`` config group (its keys and their
checks), and ``Faults``, the ``StepHooks`` (``distlib.app.runtime.hooks``) that fire them. train.py
attaches it (``step_hooks``) when a fault is configured; the trainer, the checkpointer and
``distlib.checkpoint`` see only the seams (hooks at fixed points of a step, a save hook), never a
fault. Users run these drills too (a SIGKILL mid-run, a crash inside a save, a full disk, a loss
spike, a hang, a desynchronised replica, a pre-emption, a straggler).

Under a launcher that restarts (torchrun, or ``dist.max_restarts``) a kill fires only on the job's
first start (``launcher_env.attempt()`` is 0, the same on every node), so the restarted group runs
clean, as after a real one-off failure. The divergence, stall, desync and pre-emption faults fire
once per process, the first time their step is reached; the record of what fired lives here, in
memory and not in checkpoints, so a step re-run after a guard rollback runs clean, which is what
lets a test compare the recovered run with an undisturbed one bit for bit. The straggler fault
slows every step.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from distlib.app.config.schema import ConfigError, Group, key
from distlib.app.runtime import launcher_env
from distlib.app.runtime.hooks import StepHooks
from distlib.checkpoint.sharded import SaveHook

SAVE_CRASH_POINTS = ("mid_shard", "before_manifest", "before_commit", "after_commit")
# fault.crash_in_save value -> the checkpoint.save hook point where the process dies
_CRASH_POINTS = {
    "mid_shard": "shard_written",
    "before_manifest": "shards_written",
    "before_commit": "manifest_written",
    "after_commit": "committed",
}


@dataclass(frozen=True)
class FaultConfig(Group):
    """Faults injected on purpose (every key null: none).

    kill_rank: this rank SIGKILLs itself ...
    kill_at_step: ... right after this step (on the job's first start only: not again after a restart)
    crash_in_save: every rank reaching this point of a save SIGKILLs itself: mid_shard (half its shard
        written), before_manifest (all shards fsynced), before_commit (manifest written, directory not
        renamed), after_commit
    disk_full_rank: this rank's shard write fails half-way with ENOSPC
    save_fault_step: the save (its step) that crash_in_save / disk_full_rank hit; null: the first save
    lr_spike_step: multiply the learning rate of this step's update ...
    lr_spike_factor: ... by this factor (the loss spike shows at the next step)
    nan_grad_rank: this rank's local gradients become NaN ...
    nan_grad_step: ... at this step (after backward, before the gradient sync)
    hang_rank: this rank sleeps forever ...
    hang_step: ... at the start of this step (0: before joining the process group)
    perturb_rank: this rank adds one ulp to one element of a parameter ...
    perturb_step: ... after this step's update (the desync check must catch it)
    perturb_param: the parameter to perturb (or a state buffer: an MoE block's score_bias); null: the last
        parameter
    sigterm_rank: this rank sends itself SIGTERM (a pre-emption that reaches one rank) ...
    sigterm_step: ... during this step
    slow_rank: this rank sleeps slow_seconds after every backward (a straggler on purpose, every step from
        the first) ...
    slow_seconds: ... this long
    late_rank: this rank waits late_seconds before it joins the process group, at every start (a
        worker slow to start: a replacement the others wait for) ...
    late_seconds: ... this long
    """

    GROUP = "fault"
    kill_rank: int | None = key(None, ge=0)
    kill_at_step: int | None = key(None, ge=1)
    crash_in_save: str | None = key(None, choices=SAVE_CRASH_POINTS)
    disk_full_rank: int | None = key(None, ge=0)
    save_fault_step: int | None = key(None, ge=1)
    lr_spike_step: int | None = key(None, ge=1)
    lr_spike_factor: float | None = key(None, gt=0)
    nan_grad_rank: int | None = key(None, ge=0)
    nan_grad_step: int | None = key(None, ge=1)
    hang_rank: int | None = key(None, ge=0)
    hang_step: int | None = key(None, ge=0)
    perturb_rank: int | None = key(None, ge=0)
    perturb_step: int | None = key(None, ge=1)
    perturb_param: str | None = key(None)
    sigterm_rank: int | None = key(None, ge=0)
    sigterm_step: int | None = key(None, ge=1)
    slow_rank: int | None = key(None, ge=0)
    slow_seconds: float | None = key(None, gt=0)
    late_rank: int | None = key(None, ge=0)
    late_seconds: float | None = key(None, gt=0)

    # (rank key, step key): faults that target one rank at one step
    RANKED = (
        ("nan_grad_rank", "nan_grad_step"),
        ("hang_rank", "hang_step"),
        ("perturb_rank", "perturb_step"),
        ("sigterm_rank", "sigterm_step"),
    )
    PAIRS = (
        ("kill_rank", "kill_at_step"),
        ("lr_spike_step", "lr_spike_factor"),
        *RANKED,
        ("slow_rank", "slow_seconds"),
        ("late_rank", "late_seconds"),
    )

    def check(self) -> None:
        for first, second in self.PAIRS:
            a, b = getattr(self, first), getattr(self, second)
            if (a is None) != (b is None):
                raise ConfigError(
                    f"fault.{first} and fault.{second} must be set together (got {first}={a}, {second}={b})"
                )
        if self.perturb_param is not None and self.perturb_rank is None:
            raise ConfigError("fault.perturb_param needs fault.perturb_rank and fault.perturb_step")

    @property
    def configured(self) -> bool:
        """Whether any fault is set."""
        return any(v is not None for v in self.to_dict().values())

    def check_run(self, world_size: int, steps: int, overlap: bool) -> None:
        """Faults must target an existing rank and a step the run reaches, or they test nothing."""
        for rank_key in (
            "kill_rank",
            "disk_full_rank",
            "slow_rank",
            "late_rank",
            *(r for r, _ in self.RANKED),
        ):
            rank = getattr(self, rank_key)
            if rank is not None and rank >= world_size:
                raise ConfigError(f"fault.{rank_key}={rank} is not a rank of dist.world_size={world_size}")
        for step_key in ("lr_spike_step", *(s for _, s in self.RANKED)):
            step = getattr(self, step_key)
            if step is not None and step > steps:
                raise ConfigError(
                    f"fault.{step_key}={step} is beyond train.steps={steps}; it would never fire"
                )
        if overlap and self.nan_grad_rank is not None:
            raise ConfigError(
                "fault.nan_grad_rank poisons the gradients after backward, but with zero.overlap "
                "their sync has already started there; set zero.overlap=false for this drill"
            )


def first_attempt() -> bool:
    return launcher_env.attempt() == 0


def kill_self() -> None:
    """Die the way an OOM kill or a lost node does: no cleanup, no exception handlers."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def step_hooks(cfg: FaultConfig, rank: int) -> StepHooks:
    """What a run attaches to its Trainer: ``Faults`` when any fault is configured, else the no-op hooks."""
    return Faults(cfg, rank) if cfg.configured else StepHooks()


class Faults(StepHooks):
    def __init__(self, cfg: FaultConfig, rank: int):
        self.cfg, self.rank = cfg, rank
        self.saves = 0
        self.fired: set[str] = set()

    # -- the StepHooks points: which fault fires where in a step ---------------
    def check_model(self, names: list[str]) -> None:
        name = self.cfg.perturb_param
        if name is not None and name not in names:  # a bad name fails now, not at the step
            raise ConfigError(
                f"fault.perturb_param={name!r} is not a parameter of the model or a state buffer "
                f"(known: {names})"
            )

    def joining(self) -> None:
        self.hang(0)
        self.arrive_late()

    def before_step(self, step: int) -> None:
        self.hang(step)

    def after_backward(self, step: int, grad_buffer: torch.Tensor) -> None:
        self.slow_down(step)
        self.poison_grads(step, grad_buffer)
        self.sigterm(step)

    def after_update(self, step: int, parts: list[tuple[torch.Tensor, tuple, int]]) -> None:
        self.perturb(step, parts)

    def after_step(self, step: int) -> None:
        if self.cfg.kill_rank == self.rank and self.cfg.kill_at_step == step and first_attempt():
            print(f"fault: rank {self.rank} kills itself after step {step}", file=sys.stderr)
            kill_self()

    def save_hook(self, step: int) -> SaveHook | None:
        """The hook for the save of ``step`` (None: no fault in this save)."""
        self.saves += 1
        target = self.cfg.save_fault_step
        if not first_attempt() or (step != target if target is not None else self.saves != 1):
            return None
        crash_at = _CRASH_POINTS.get(self.cfg.crash_in_save or "")
        disk_full = self.cfg.disk_full_rank == self.rank

        def hook(point: str, path: Path) -> None:
            if point == "shard_written" and (disk_full or crash_at == point):
                _truncate_to_half(path)  # what a full disk or a crash mid-write leaves behind
            if disk_full and point == "shard_written":
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by fault.disk_full_rank)")
            if point == crash_at:
                print(
                    f"fault: rank {self.rank} dies in the step-{step} save at {self.cfg.crash_in_save}",
                    file=sys.stderr,
                )
                kill_self()

        return hook if (crash_at or disk_full) else None

    def _fires(self, name: str, step: int, at_step: int | None, on_rank: int | None = None) -> bool:
        if at_step is None or step != at_step or name in self.fired:
            return False
        if on_rank is not None and on_rank != self.rank:
            return False
        self.fired.add(name)
        return True

    def _say(self, what: str) -> None:
        print(f"fault injection: rank {self.rank}: {what}", file=sys.stderr, flush=True)

    def hang(self, step: int) -> None:
        """fault.hang_rank / hang_step: stall forever (step 0: before the rendezvous)."""
        if self._fires("hang", step, self.cfg.hang_step, self.cfg.hang_rank):
            self._say(f"hanging at step {step}" if step else "hanging before the rendezvous")
            while True:
                time.sleep(3600)

    def arrive_late(self) -> None:
        """fault.late_rank / late_seconds: this rank joins the process group late, at every start."""
        if self.cfg.late_rank == self.rank:
            self._say(f"waiting {self.cfg.late_seconds:g} s before joining the process group")
            time.sleep(self.cfg.late_seconds)

    def slow_down(self, step: int) -> None:
        """fault.slow_rank / slow_seconds: this rank computes slowly, every step: it sleeps after its
        backward, before the gradient sync, where the other ranks then wait for it (a straggler)."""
        if self.cfg.slow_rank == self.rank:
            if "slow" not in self.fired:
                self.fired.add("slow")
                self._say(f"sleeping {self.cfg.slow_seconds:g} s after every backward from step {step}")
            time.sleep(self.cfg.slow_seconds)

    def lr_factor(self, step: int) -> float:
        """fault.lr_spike_step / lr_spike_factor: the factor for this step's learning rate."""
        if self._fires("lr_spike", step, self.cfg.lr_spike_step):
            if self.rank == 0:
                self._say(f"learning rate x {self.cfg.lr_spike_factor:g} at step {step}")
            return float(self.cfg.lr_spike_factor)
        return 1.0

    def poison_grads(self, step: int, grads: torch.Tensor) -> None:
        """fault.nan_grad_rank / nan_grad_step: this rank's local gradients become NaN."""
        if self._fires("nan_grad", step, self.cfg.nan_grad_step, self.cfg.nan_grad_rank):
            self._say(f"NaN gradients at step {step}")
            grads.fill_(float("nan"))

    def perturb(self, step: int, parts: list[tuple[torch.Tensor, tuple, int]]) -> None:
        """fault.perturb_rank / perturb_step: one ulp added to the first element of one parameter
        that this rank holds. Of each part ``(params, slots, start)``, ``params`` holds flat offsets
        [start, start + numel) (at ZeRO stage 3 a partition, which may hold only part of the
        parameter, or none of it; under dist.ep a rank holds only its experts)."""
        if self._fires("perturb", step, self.cfg.perturb_step, self.cfg.perturb_rank):
            name = self.cfg.perturb_param
            if name is None:  # the last parameter
                params, slots, start = parts[0]
                held = [(params, slots[-1], start)]
            else:
                held = [(p, s, start) for p, slots, start in parts for s in slots if s.name == name]
            if not held:
                self._say(f"holds no {name} (another rank's expert) after step {step}: nothing perturbed")
                return
            params, slot, start = held[0]
            first = max(slot.offset, start) - start
            if first >= min(slot.offset + slot.numel - start, params.numel()):
                self._say(f"holds no element of {slot.name} after step {step}: nothing perturbed")
                return
            with torch.no_grad():
                value = params[first : first + 1]
                value.copy_(torch.nextafter(value, torch.full_like(value, float("inf"))))
            index = start + first - slot.offset
            self._say(f"perturbed {slot.name}[{index}] (flat) by one ulp after step {step}")

    def sigterm(self, step: int) -> None:
        """fault.sigterm_rank / sigterm_step: a pre-emption signal that reaches only this rank."""
        if self._fires("sigterm", step, self.cfg.sigterm_step, self.cfg.sigterm_rank):
            self._say(f"sending SIGTERM to itself during step {step}")
            os.kill(os.getpid(), signal.SIGTERM)
