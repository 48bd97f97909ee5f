"""The ``dist`` config group: processes, transport, and the parallel layout (tensor and pipeline).

``dist.pp`` = P splits the model's blocks into P contiguous stages (``pp_virtual`` = v chunks per
rank with the interleaved schedule: P x v chunks); ``train.grad_accum`` is the number of
micro-batches a schedule pipelines. The world is tp x dp x pp ranks (``distlib.comm.mesh``).
"""
from __future__ import annotations

from dataclasses import dataclass

from distlib.app import devices   # looked up at call time (tests stand in GPUs for it)

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")


class ConfigError(ValueError):
    """A configuration value that cannot work, with the key that holds it."""


@dataclass(frozen=True)
class DistConfig:
    world_size: int = 4
    backend: str = "gloo"
    timeout_s: float = 60.0
    tp: int = 1
    check_collectives: bool = True
    pp: int = 1                   # pipeline stages
    pp_schedule: str = "1f1b"     # gpipe | 1f1b | interleaved
    pp_virtual: int = 1           # model chunks per rank (interleaved only)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"dist.world_size must be >= 1, got {self.world_size}")
        for name in ("tp", "pp", "pp_virtual"):
            if getattr(self, name) < 1:
                raise ConfigError(f"dist.{name} must be >= 1, got {getattr(self, name)}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"dist.pp_schedule must be one of {list(PP_SCHEDULES)}, got {self.pp_schedule!r}")
        if self.pp_virtual > 1 and self.pp_schedule != "interleaved":
            raise ConfigError(f"dist.pp_virtual={self.pp_virtual} needs dist.pp_schedule=interleaved "
                              f"(got {self.pp_schedule})")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"dist.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.backend == "nccl" and not devices.cuda_devices():
            # Without this check the run would die later, as a rendezvous "timeout".
            raise ConfigError(f"dist.backend=nccl needs CUDA GPUs but {devices.no_cuda_reason()}; use dist.backend=gloo")
        if not self.timeout_s > 0:
            raise ConfigError(f"dist.timeout_s must be > 0, got {self.timeout_s}")


def check_pipeline(dist: DistConfig, n_layers: int, grad_accum: int, eval_every: int) -> None:
    """The pipeline layout against the model and the step: one line naming the problem."""
    if dist.pp == 1:
        return
    chunks = dist.pp * dist.pp_virtual
    if n_layers % chunks:
        raise ConfigError(f"model.n_layers={n_layers} does not split into dist.pp x dist.pp_virtual = "
                          f"{dist.pp} x {dist.pp_virtual} = {chunks} equal pipeline chunks")
    if dist.pp_schedule == "interleaved" and grad_accum % dist.pp:
        raise ConfigError(f"dist.pp_schedule=interleaved needs train.grad_accum (micro-batches, "
                          f"{grad_accum}) to be a multiple of dist.pp={dist.pp}")
    if eval_every:
        raise ConfigError(f"train.eval_every={eval_every} is not supported with dist.pp={dist.pp} "
                          f"(the held-out loss runs the whole model on one rank); set train.eval_every=0")
