"""The config groups of a training run: the optimizer, ZeRO, the loop and the metrics (the model's:
``model_group``; the data's: ``data_group``).

Each key is declared once, here (``schema.key``): default, meaning, allowed values. Rules between
the keys of one group are the group's ``check``; rules across groups are in ``run.py``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from distlib.app.config.schema import ConfigError, Group, key
from distlib.parallel.adamw import AdamWConfig
from distlib.parallel.zero.buckets import BUCKET_NUMEL

DTYPES = ("fp32", "bf16")  # train.dtype; distlib.app.config.run maps them to torch dtypes
DEVICES = ("auto", "cpu", "cuda")
SCHEDULES = ("constant", "cosine", "wsd")


@dataclass(frozen=True)
class OptimizerConfig(Group):
    """AdamW (bitwise torch.optim.AdamW's update), gradient clipping and the learning rate schedule.

    lr: peak learning rate (constant by default; see schedule)
    beta1: AdamW's first-moment decay
    beta2: AdamW's second-moment decay
    eps: added to AdamW's denominator
    weight_decay: decoupled weight decay, applied as p *= 1 - lr x weight_decay
    grad_clip: clip the global gradient norm to this value; 0 disables
    schedule: the learning rate per step, a function of the step alone (a resume continues it bit for bit):
        constant, cosine (to min_lr_ratio x lr at train.steps) or wsd (warmup, stable, then a linear decay
        over the last decay_steps)
    warmup_steps: linear warmup: step t <= W runs at lr x t / W (any schedule)
    decay_steps: wsd only: the final decay phase, in steps (>= 1 for wsd)
    min_lr_ratio: cosine / wsd: the rate at the end of the decay, as a fraction of lr
    """

    GROUP = "optimizer"
    lr: float = key(0.01, gt=0)
    beta1: float = key(0.9, ge=0, lt=1)
    beta2: float = key(0.999, ge=0, lt=1)
    eps: float = key(1e-8, gt=0)
    weight_decay: float = key(0.01, ge=0)
    grad_clip: float = key(0.0, ge=0)
    schedule: str = key("constant", choices=SCHEDULES)
    warmup_steps: int = key(0, ge=0)
    decay_steps: int = key(0, ge=0)
    min_lr_ratio: float = key(0.0, ge=0, le=1)

    def check(self) -> None:
        if self.schedule == "wsd" and self.decay_steps < 1:
            raise ConfigError(
                "optimizer.schedule=wsd needs optimizer.decay_steps >= 1 (its final decay phase)"
            )
        if self.schedule != "wsd" and self.decay_steps:
            raise ConfigError(
                f"optimizer.decay_steps is used by schedule=wsd only (schedule={self.schedule}; "
                f"cosine decays from the end of warmup to train.steps)"
            )

    @property
    def adamw(self) -> AdamWConfig:
        return AdamWConfig(
            lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay
        )


@dataclass(frozen=True)
class ZeroConfig(Group):
    """How the optimizer state, gradients and parameters are sharded over the data-parallel ranks.

    stage: 0: plain data parallelism (all-reduce, full AdamW state everywhere); 1: optimizer state sharded
        (12P/N); 2: gradients sharded too; 3: parameters sharded too
    bucket_numel: gradient bucket size in elements at stage 2 (and stages 0/1 with overlap); whole modules
        per bucket
    overlap: start the gradient sync from backward hooks on a communication thread (stage 3: also prefetch
        the next block's parameters); not bitwise equal to false at stages 0/1
    """

    GROUP = "zero"
    stage: int = key(1, choices=(0, 1, 2, 3))
    bucket_numel: int = key(BUCKET_NUMEL, ge=1)
    overlap: bool = key(False)


@dataclass(frozen=True)
class TrainConfig(Group):
    """The loop: steps, batch, accumulation, the invariants' reach, evaluation, precision, device.

    steps: optimizer steps; the run ends by itself after the last one
    global_batch: sequences per optimizer step over all data-parallel ranks; fixed, so every world size sees
        the same data and the same losses
    batch_size: sequences per data-parallel rank per micro-batch; null = derived from global_batch (to size
        per rank, set global_batch=null and batch_size=K)
    grad_accum: micro-batches per rank per optimizer step
    loss_tolerance: invariant 1: loss[t+1] <= loss[t] x (1 + loss_tolerance)
    monotone_until_step: invariant 1 covers steps up to this one (near convergence the per-step loss is
        noisy); 0 disables it
    eval_every: validation loss on the held-out split every K steps (needs data.val_fraction > 0); 0 = off
    eval_windows: held-out windows scored per evaluation (the first ones; the same every time)
    profile_steps: [a, b]: a torch.profiler Chrome trace of steps a..b per rank in <run
        dir>/traces/rank<R>.json, every collective a named range; scripts/report.py splits each rank's time
        with it
    dtype: bf16: bf16 parameters and activations, fp32 gradients, master weights and Adam state
    device: cpu, cuda (rank r on GPU LOCAL_RANK % GPUs; with gloo several ranks share a GPU), or auto (cuda
        with nccl, else cpu); docs/gpu.md
    """

    GROUP = "train"
    steps: int = key(20, ge=1)
    global_batch: int | None = key(16, ge=1)
    batch_size: int | None = key(None, ge=1)
    grad_accum: int = key(1, ge=1)
    loss_tolerance: float = key(1e-6, ge=0)
    monotone_until_step: int = key(20, ge=0)
    eval_every: int = key(0, ge=0)
    eval_windows: int = key(128, ge=1)
    profile_steps: tuple[int, int] | None = key(None)
    dtype: str = key("fp32", choices=DTYPES)
    device: str = key("auto", choices=DEVICES)

    def check(self) -> None:
        if self.profile_steps is not None:
            a, b = self.profile_steps
            if not 1 <= a <= b <= self.steps:
                raise ConfigError(
                    f"train.profile_steps must be [a, b] with 1 <= a <= b <= train.steps={self.steps}, "
                    f"got {list(self.profile_steps)}"
                )
        if self.batch_size is None and self.global_batch is None:
            raise ConfigError("set train.global_batch or train.batch_size (both are null)")


@dataclass(frozen=True)
class MetricsConfig(Group):
    """What rank 0 logs (metrics.jsonl, schema in docs/unattended.md) and prints.

    file: rank 0's JSONL log in the run directory: a record per step plus events
    per_rank: also write metrics.rank<R>.jsonl with each rank's own values
    progress_every: rank 0 prints a one-line progress report every K steps; 0 disables
    tensorboard: also write rank 0's step records as TensorBoard event files in <run dir>/tensorboard/
        (loss, grad norm, lr, step time, tokens/s, MFU, memory, validation loss); needs the optional
        `tensorboard` extra
    peak_flops: MFU's peak per rank in FLOP/s; null = the GPU's data-sheet figure for train.dtype
        (A100, H100, H200) or, on any other device, measured (a few 256x256 fp32 matmuls); the run prints
        which
    step_peak: count every tensor alive on the rank over the model's build and the run's first two
        steps (a dispatch mode: a Python call per operator; later steps run at full speed) and report
        the most bytes alive at once in a step, from its batches to its update, in the step records'
        memory (step_peak_bytes) and the memory profile: what `scripts/plan.py` predicts as the step
        peak
    """

    GROUP = "metrics"
    file: str = key("metrics.jsonl")
    per_rank: bool = key(False)
    progress_every: int = key(1, ge=0)
    tensorboard: bool = key(False)
    peak_flops: float | None = key(None, gt=0)
    step_peak: bool = key(False)

    def check(self) -> None:
        if not self.file or "/" in self.file:
            raise ConfigError(
                f"metrics.file must be a plain file name in the run directory, got {self.file!r}"
            )
        # Looked up, not imported: the writer is imported by the run that uses it (observe.tensorboard).
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                "metrics.tensorboard=true needs the optional `tensorboard` extra "
                "(pip install tensorboard==2.21.0), which is not installed"
            )
