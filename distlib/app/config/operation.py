"""The config groups of how a run is operated: processes and layout, checkpoints, the guard.

Each key is declared once, here (``schema.key``); rules between groups are in ``run.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlib.app.config.schema import ConfigError, Group, key

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class DistConfig(Group):
    GROUP = "dist"
    world_size: int = key(
        4,
        "processes: `python train.py` starts this many; under torchrun it defaults to "
        "torchrun's world size, and an explicit value must match it",
        ge=1,
    )
    backend: str = key(
        "gloo",
        "gloo (host transport; CUDA tensors are staged through pinned host memory) or nccl "
        "(needs CUDA and train.device cuda/auto)",
        choices=("gloo", "nccl"),
    )
    timeout_s: float = key(60.0, "every collective and the rendezvous fail after this many seconds", gt=0)
    tp: int = key(
        1,
        "tensor-parallel degree: attention heads and the MLP split over this many ranks (divides "
        "world_size and model.n_heads); ZeRO shards over the world_size / tp data-parallel ranks",
        ge=1,
    )
    check_collectives: bool = key(
        True,
        "every collective carries a small header, so a size/dtype/kind mismatch "
        "between ranks is a clear error instead of a hang or silent truncation",
    )
    pp: int = key(
        1,
        "pipeline stages: the blocks split into pp contiguous stages (embeddings with the first, the "
        "head and loss with the last); world_size = data x tp x pp",
        ge=1,
    )
    pp_schedule: str = key(
        "1f1b",
        "the order of the train.grad_accum micro-batches' forwards and backwards",
        choices=PP_SCHEDULES,
    )
    pp_virtual: int = key(
        1,
        "model chunks per rank (interleaved only); model.n_layers must divide into pp x pp_virtual chunks",
        ge=1,
    )

    def check(self) -> None:
        if self.pp_virtual > 1 and self.pp_schedule != "interleaved":
            raise ConfigError(
                f"dist.pp_virtual={self.pp_virtual} needs dist.pp_schedule=interleaved "
                f"(got {self.pp_schedule})"
            )


@dataclass(frozen=True)
class CheckpointConfig(Group):
    GROUP = "checkpoint"
    dir: str = key("checkpoints", "where checkpoints go: relative to the run directory, or absolute")
    every_steps: int = key(10, "save after every K-th step; 0 disables step-based saving", ge=0)
    every_minutes: float = key(
        30.0,
        "also save when this many minutes passed since the last save (rank 0's clock "
        "decides for all ranks); 0 disables. SIGTERM/SIGINT/SIGUSR2 always save",
        ge=0,
    )
    resume: str | None = key(
        None,
        "null: start fresh; latest: the newest checkpoint in `dir` that verifies "
        "(damaged newer ones are reported and moved aside; none at all: start fresh); or a "
        "checkpoint path, loaded exactly or the run fails. Another world size or ZeRO stage "
        "is resharded on load",
    )
    verify_resume: bool = key(
        True,
        "at the end, reload the first checkpoint (with keep_last: the newest) into a "
        "fresh model and optimizer and compare every byte (invariant 4)",
    )
    keep_last: int = key(
        0,
        "after each committed save keep only the newest K checkpoints (with the guard on: once "
        "the next step passed it); 0 keeps all",
        ge=0,
    )
    async_save: bool = key(
        False,
        "copy each rank's shard into reused host buffers and write, fsync, hash and "
        "commit it in a background thread; committed at a later step boundary once every "
        "rank's write succeeded (docs/checkpoints.md)",
    )
    memory_every_steps: int = key(
        0,
        "every K steps also keep each rank's shard in /dev/shm (only the newest, "
        "sha256-checked; with several nodes a replica on the next node); a restart with "
        "resume=latest resumes from it; removed when the job ends; 0 disables",
        ge=0,
    )


@dataclass(frozen=True)
class GuardConfig(Group):
    GROUP = "guard"
    enabled: bool = key(
        True,
        "check every step for a non-finite loss or grad norm and for loss spikes; on a trip "
        "no update is applied and the run rolls back to the newest trusted checkpoint",
    )
    spike_factor: float = key(2.0, "trip when the loss > spike_factor x the reference", gt=1)
    spike_window: int = key(
        1, "reference = the mean of the last K accepted losses (1: the previous step's)", ge=1
    )
    skip_batches: int = key(
        0, "after a rollback, skip this many batches (PaLM-style); 0 replays the same data", ge=0
    )
    max_rollbacks: int = key(
        3, "rollbacks allowed per run; the next trip stops the run with an error (exit 1)", ge=0
    )
    check_sync_every: int = key(
        10,
        "every K steps compare a sha256 per parameter across the ranks that must hold "
        "the same bytes; 0 disables",
        ge=0,
    )
    straggler_factor: float = key(
        1.5, "a rank busier (outside collectives) than factor x the median rank ...", gt=1
    )
    straggler_window: int = key(
        5, "... for this many steps in a row gets a `straggler` event naming it", ge=1
    )
