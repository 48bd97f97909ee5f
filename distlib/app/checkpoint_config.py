"""The checkpoint group's configuration (``conf/checkpoint/``). Bad values raise ValueError, which
``config`` reports as a ConfigError naming the key."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = "checkpoints"
    every_steps: int = 10
    every_minutes: float = 30.0
    resume: str | None = None
    verify_resume: bool = True
    keep_last: int = 0
    async_save: bool = False        # write/fsync/hash/commit in a background thread (docs/checkpoints.md)
    memory_every_steps: int = 0     # a snapshot in /dev/shm every K steps, resumed from first (0: off)

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"checkpoint.every_steps must be >= 0, got {self.every_steps}")
        if not self.every_minutes >= 0:
            raise ValueError(f"checkpoint.every_minutes must be >= 0 (0 disables), got {self.every_minutes}")
        if self.keep_last < 0:
            raise ValueError(f"checkpoint.keep_last must be >= 0 (0 keeps all), got {self.keep_last}")
        if isinstance(self.memory_every_steps, bool) or not isinstance(self.memory_every_steps, int) \
                or self.memory_every_steps < 0:
            raise ValueError(f"checkpoint.memory_every_steps must be an integer >= 0 (0 disables), "
                             f"got {self.memory_every_steps!r}")
        if not isinstance(self.async_save, bool):
            raise ValueError(f"checkpoint.async_save must be true or false, got {self.async_save!r}")
