"""Faults injected on purpose (``fault.*``), to prove the run survives or reports them.

Each fault fires once per process: the first time its step is reached. The record of
what fired lives here, in memory and not in checkpoints, so when the guard rolls back
and the same step runs again it runs clean, which is what lets a test compare the
recovered run with an undisturbed one bit for bit. (A new process, e.g. after a
torchrun restart, starts with a clean record.)
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch

from distlib.config import ConfigError, FaultConfig


class FaultInjector:
    def __init__(self, cfg: FaultConfig, rank: int):
        self.cfg, self.rank = cfg, rank
        self.fired: set[str] = set()

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

    def perturb(self, step: int, flat_params: torch.Tensor, slots) -> None:
        """fault.perturb_rank / perturb_step: one ulp added to the first element of one parameter."""
        if self._fires("perturb", step, self.cfg.perturb_step, self.cfg.perturb_rank):
            slot = self.perturbed_slot(slots)
            with torch.no_grad():
                value = flat_params[slot.offset:slot.offset + 1]
                value.copy_(torch.nextafter(value, torch.full_like(value, float("inf"))))
            self._say(f"perturbed {slot.name}[0] by one ulp after step {step}")

    def perturbed_slot(self, slots):
        name = self.cfg.perturb_param
        if name is None:
            return slots[-1]
        for slot in slots:
            if slot.name == name:
                return slot
        raise ConfigError(f"fault.perturb_param={name!r} is not a parameter of the model "
                         f"(known: {[s.name for s in slots]})")

    def sigterm(self, step: int) -> None:
        """fault.sigterm_rank / sigterm_step: a pre-emption signal that reaches only this rank."""
        if self._fires("sigterm", step, self.cfg.sigterm_step, self.cfg.sigterm_rank):
            self._say(f"sending SIGTERM to itself during step {step}")
            os.kill(os.getpid(), signal.SIGTERM)
