"""What a run returns: one record per step and the run's summary, the same on every rank.

The per-rank values in them (parameter norms, memory rows, the resume check's mismatches) came
through collectives, so every rank holds the same ``RunResult`` and reaches the same verdict on
the invariants (``summary.check_invariants``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distlib.app.checkpointing.resume_check import ResumeCheck


@dataclass
class StepLog:
    step: int
    loss: float
    grad_norm: float
    param_norms: list[float]  # one per rank, after the update
    seconds: float
    val_loss: float | None = None  # held-out loss after this step, on evaluation steps


@dataclass
class RunResult:
    start_step: int
    steps: list[StepLog] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)  # per rank: measured / expected / allowance
    manifests: list[dict] = field(default_factory=list)
    resume_check: ResumeCheck | None = None
    numel: int = 0
    rollbacks: list[dict] = field(default_factory=list)  # one per guard trip that rolled back
    stopped_by: str | None = None  # e.g. "SIGTERM": saved and left early
