"""The guard group's configuration (``conf/guard/``): divergence guard, rollback, desync check and
straggler detection. Bad values raise ValueError, which ``config`` reports as a ConfigError naming
the key."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GuardConfig:
    enabled: bool = True
    spike_factor: float = 2.0
    spike_window: int = 1
    skip_batches: int = 0
    max_rollbacks: int = 3
    check_sync_every: int = 10
    straggler_factor: float = 1.5   # a rank busy > factor x the median rank's time ...
    straggler_window: int = 5       # ... this many steps in a row gets a straggler event

    def __post_init__(self) -> None:
        for name in ("spike_factor", "straggler_factor"):
            if not getattr(self, name) > 1.0:
                raise ValueError(f"guard.{name} must be > 1, got {getattr(self, name)}")
        for name in ("spike_window", "straggler_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"guard.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("skip_batches", "max_rollbacks", "check_sync_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"guard.{name} must be >= 0, got {getattr(self, name)}")
