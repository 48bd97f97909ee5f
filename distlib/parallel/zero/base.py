"""What every ZeRO stage shares: the step protocol, AdamW on the master, checkpoint state, memory.

All parameters are laid out in one flat buffer (``distlib.parallel.flat_layout``), padded to a
multiple of the data-parallel size N; rank r owns partition r. ``step()`` replaces
``optimizer.step()``; it is ``sync_grads()`` (average the gradients, return the global grad
norm) followed by ``apply_update(lr)`` (clip by that norm, AdamW on the fp32 master, publish the
parameters), so a caller can look at the norm and the loss before deciding to update.

A stage says where things live by implementing the hooks at the bottom of ``StageOptimizer``:
its storage (``_init_storage``, which also names ``grad_home``, the fp32 tensor gradients land in),
what it holds beyond that (``_param_storage``/``_grad_storage``), how the
gradients are averaged (``_reduce_grads``) and how updated master weights reach the module
(``_publish_params``). Whatever the stage, a checkpoint holds partition r of the fp32 (master,
exp_avg, exp_avg_sq) on rank r, so the on-disk format does not depend on the stage.

Mixed precision (``param_dtype=torch.bfloat16``): the module computes with bf16 parameters;
gradients are accumulated and reduced in fp32 and the master weights and Adam state stay fp32.

Overlap (``overlap=True``, off by default): the gradient collectives start from backward hooks and
run on a communication thread (``comm.progress.Progress``) while backward computes -- stages 0/1
in buckets on the last micro-batch (``overlap.OverlappedSync``), stage 2/3's bucket
reduce-scatters without blocking the hook, and stage 3 prefetches the next unit's parameters.
``sync_grads`` waits for all of it before the norm; no other collective of the group runs on
the main thread while any is in flight.

The keywords: ``names``, the parameters it updates (default: the module's; a
``optimizer.ParamGroup``'s); ``tp``/``tp_split``, the tensor-parallel group and the parameters split
over it; ``tp_partial``, the parameters whose gradient each tensor-parallel rank computes a share
of (summed over ``tp`` once per step, ``partial_sums``); ``differs_over``, any parameter -> the
groups whose ranks hold other values of it, and ``pp``, the pipeline group: the global norms count
such parameters on every rank of those groups and replicated ones once (``norms``);
``segments``, parameter names no stage-2 gradient bucket spans two of (an interleaved pipeline
stage's chunks, ``buckets.buckets_by_size``); ``queue``, what makes the overlap's queue of jobs
(``Progress``; the planner's step peak runs one that keeps what a job frees until it is waited for).

Device: every buffer (flat parameters, gradients, master weights, Adam state, buckets) is
allocated on the device of the module's parameters (``self.device``); ``state_shard`` and
``params_snapshot`` return host copies, which is what a checkpoint writes and compares.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import torch
import torch.nn as nn

from distlib.comm.group import Comm
from distlib.comm.progress import Progress
from distlib.parallel.adamw import AdamWConfig, adamw_step_
from distlib.parallel.flat_layout import FlatLayout
from distlib.parallel.zero import predict
from distlib.parallel.zero.buckets import BUCKET_NUMEL, buckets_by_size
from distlib.parallel.zero.flat_grads import flat_grad_buffer
from distlib.parallel.zero.memory import PeakMemory, Sizes
from distlib.parallel.zero.norms import NormTerms
from distlib.parallel.zero.overlap import OverlappedSync
from distlib.parallel.zero.partial_sums import PartialSums
from distlib.parallel.zero.shard_state import ShardState


class StageOptimizer(ShardState):
    """AdamW over the data-parallel group ``comm``; the stage subclasses decide what is sharded
    (the keywords: this module's docstring)."""

    stage: int
    whole_grads = False  # whether _reduce_grads returns every gradient (stage 0) or the partition's
    overlapped: OverlappedSync | None = None  # stages 0/1 with overlap: the sync started in backward

    def __init__(
        self,
        module: nn.Module,
        comm: Comm,
        cfg: AdamWConfig,
        grad_clip: float = 0.0,
        *,
        tp: Comm | None = None,
        tp_split: Collection[str] = (),
        differs_over: Mapping[str, tuple[Comm, ...]] | None = None,
        tp_partial: Collection[str] = (),
        names: Collection[str] | None = None,
        param_dtype: torch.dtype = torch.float32,
        bucket_numel: int = BUCKET_NUMEL,
        segments: Sequence[Collection[str]] = (),
        overlap: bool = False,
        grad_accum: int = 1,
        pp: Comm | None = None,
        queue: Callable[[Comm], Progress] = Progress,
    ):
        if grad_clip < 0:
            raise ValueError(f"optimizer.grad_clip must be >= 0 (0 disables), got {grad_clip}")
        if param_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"parameter dtype must be float32 or bfloat16, got {param_dtype}")
        self.module, self.comm, self.cfg, self.grad_clip = module, comm, cfg, grad_clip
        self.param_dtype, self.low_precision = param_dtype, param_dtype != torch.float32
        self.bucket_numel, self.segments, self.grad_accum = bucket_numel, segments, grad_accum
        self.progress = queue(comm) if overlap else None  # the communication thread's queue
        self.layout = FlatLayout.of(module, comm.size, names)
        named = dict(module.named_parameters())  # (once: per slot it was 0.09 s of a mixtral_tiny build)
        self.params = [named[s.name] for s in self.layout.slots]
        self.device = self.params[0].device
        self.step_count = 0
        self._synced: tuple[torch.Tensor, float] | None = None  # set by sync_grads, used by apply_update
        self.my_range = slice(*self.layout.shard_range(comm.rank))
        self.norms = NormTerms(self.layout, comm, differs_over, pp, tp=tp, tp_split=tp_split)
        reduced = slice(0, self.layout.padded_numel) if self.whole_grads else self.my_range
        self.partial = PartialSums(self.layout, tp, set(tp_partial), (reduced.start, reduced.stop))
        self._memory = PeakMemory()
        fp32_flat = self.layout.flatten(self.params, self.device)
        self._init_storage(fp32_flat)
        del fp32_flat
        self._sample_memory()

    # -- storage the stages share ---------------------------------------------------
    def _replicated_params(self, fp32_flat: torch.Tensor) -> None:
        """Every parameter on every rank (stages 0-2): the module's parameters become views of
        ``flat_params``, in the compute dtype."""
        self.flat_params = fp32_flat.to(self.param_dtype) if self.low_precision else fp32_flat
        for slot, p in zip(self.layout.slots, self.params):
            p.data = self.flat_params[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def _replicated_grads(self, scatter: bool) -> None:
        """Every parameter's gradient in one flat buffer (stages 0/1: the gradients' home); with
        overlap, its sync in buckets from the last backward's hooks (``scatter``: reduce-scatter,
        else all-reduce)."""
        self.flat_grads = flat_grad_buffer(self.layout, self.params, self.low_precision, self._sample_memory)
        self.grad_home = self.flat_grads
        if self.progress is not None:
            self.overlapped = OverlappedSync(
                self.layout,
                self.params,
                self.flat_grads,
                self.comm,
                buckets_by_size(self.module, self.params, self.layout, self.bucket_numel),
                self.progress,
                scatter=scatter,
                accum=self.grad_accum,
            )

    def _partitioned_state(self, fp32_flat: torch.Tensor) -> None:
        """fp32 master weights and Adam moments of this rank's partition only (stages 1-3)."""
        self.master = fp32_flat[self.my_range].clone()
        self.exp_avg = torch.zeros(self.layout.shard_numel, device=self.device)
        self.exp_avg_sq = torch.zeros(self.layout.shard_numel, device=self.device)

    # -- the step -------------------------------------------------------------------
    @torch.no_grad()
    def sync_grads(self) -> float:
        """First half of ``step``: average the gradients over the data-parallel ranks (this rank keeps
        what it updates) and return the global grad norm (before clipping), identical on every rank.
        Nothing is updated yet, so a caller can still decide not to ``apply_update``."""
        return self.use_norm(self.norms.finish(self.sync_squares()))

    @torch.no_grad()
    def sync_squares(self) -> torch.Tensor:
        """``sync_grads`` short of the norm: average the gradients, return this stage's sum of their
        squares (a group's share of ``optimizer.ZeroOptimizer``'s norm, which ``use_norm`` sets)."""
        grads = self._reduce_grads()
        self.partial.sum_(grads)
        self._synced = (grads, None)
        return self.norms.squares_of_partition(self._mine(grads))

    def use_norm(self, grad_norm: float) -> float:
        """Set the global gradient norm ``apply_update`` clips by (after ``sync_squares``)."""
        if self._synced is None:
            raise RuntimeError("use_norm() needs sync_squares() first")
        self._synced = (self._synced[0], grad_norm)
        return grad_norm

    def synced_grad_partition(self) -> torch.Tensor:
        """This rank's partition of the averaged gradient ``sync_grads`` produced (tests inspect it)."""
        if self._synced is None:
            raise RuntimeError("synced_grad_partition() needs sync_grads() first")
        return self._mine(self._synced[0])

    @torch.no_grad()
    def apply_update(self, lr: float | None = None) -> None:
        """Second half of ``step``: clip by the global norm, AdamW on the master, publish the params."""
        if self._synced is None:
            raise RuntimeError(
                f"{type(self).__name__}.apply_update() needs sync_grads() first (once per update)"
            )
        (grads, grad_norm), self._synced = self._synced, None
        if self.grad_clip > 0:
            coef = min(self.grad_clip / (grad_norm + 1e-6), 1.0)  # torch.nn.utils.clip_grad_norm_'s
            if coef < 1.0:
                grads.mul_(coef)
        self.step_count += 1
        adamw_step_(self.master, grads, self.exp_avg, self.exp_avg_sq, self.step_count, self.cfg, lr)
        self._publish_params()
        self._sample_memory()

    def step(self, lr: float | None = None) -> float:
        """Replaces ``optimizer.step()``. Returns the global grad norm (before clipping)."""
        grad_norm = self.sync_grads()
        self.apply_update(lr)
        return grad_norm

    def zero_grad(self) -> None:
        """Clear the gradients (and drop synchronised ones that were never applied)."""
        if self.progress is not None:
            self.progress.drain()
        self._zero_grads()
        self._synced = None

    def param_norm(self) -> float:
        """Norm of the whole (unsharded) model's parameters, from this rank's copy of them."""
        return self.norms.finish(self.param_squares())

    def param_squares(self) -> torch.Tensor:
        """This stage's sum of squares of the parameters (a group's share of ``param_norm``)."""
        return self.norms.squares_of_full(self.flat_params)

    # -- what a rank holds ---------------------------------------------------------
    @property
    def param_buffer(self) -> torch.Tensor:
        """The parameter values this rank holds, flat: all of them at stages 0-2, its partition at 3
        (with tensor parallelism, of its tensor-parallel shard of the model)."""
        return self.flat_params

    @property
    def param_buffer_start(self) -> int:
        """Flat offset of ``param_buffer``'s first element (0, or the partition's start at stage 3)."""
        return 0

    def param_parts(self) -> list[tuple[torch.Tensor, tuple, int]]:
        """Per parameter group (one here): param_buffer, its slots, param_buffer_start, for hooks."""
        return [(self.param_buffer, self.layout.slots, self.param_buffer_start)]

    def full_params(self) -> torch.Tensor:
        """Every parameter of this rank's model (its tensor-parallel shard), flat in layout order:
        the live buffer at stages 0-2; at stage 3 a gathered copy (collective over the group)."""
        return self.flat_params

    def replica_parts(self) -> list[tuple[torch.Tensor, tuple, bool]]:
        """Per parameter group: every parameter (``full_params``), its slots, and whether the ranks
        of an expert group hold other ones of them (never, here): what the replica check compares."""
        return [(self.full_params(), self.layout.slots, False)]

    def params_snapshot(self) -> torch.Tensor:
        """A host copy of the parameter bytes this rank holds (for byte-exact restore checks)."""
        return self.param_buffer.to("cpu", copy=True)

    # -- memory -----------------------------------------------------------------------
    def _sample_memory(self) -> None:
        self._memory.sample(
            {
                "params": self._param_storage(),
                "grads": self._grad_storage() + [p.grad for p in self.params if p.grad is not None],
                "optimizer": [self.master, self.exp_avg, self.exp_avg_sq],
            }
        )

    def memory_bytes(self) -> dict[str, int]:
        """Peak bytes, per category, of the tensors alive on this rank (measured, not the formula)."""
        return self._memory.peaks()

    def _sizes(self) -> Sizes:
        return Sizes.of(self.layout, self.param_dtype)

    def _predicted_peaks(self) -> predict.Peaks:
        """What ``predict`` says this optimizer's tensors peak at (what ``PeakMemory`` measures)."""
        overlap = self.progress is not None
        return predict.peak_bytes(
            self.stage, self.module, self.layout, self.param_dtype, self.bucket_numel, overlap, self.segments
        )

    # -- what each stage implements -----------------------------------------------------
    def memory_formula(self) -> dict[str, tuple[float, float, str]]:
        """category -> (formula bytes, allowed extra bytes, formula text), see memory.Sizes."""
        raise NotImplementedError

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The fp32 buffer gradients accumulate into before ``sync_grads`` (``_init_storage`` sets
        ``grad_home``): all of them at stages 0/1, this rank's (already reduced) partition at 2/3."""
        return self.grad_home

    def _init_storage(self, fp32_flat: torch.Tensor) -> None:
        """Allocate parameters, gradients and state from the fp32 copy of the initial weights."""
        raise NotImplementedError

    def _param_storage(self) -> list[torch.Tensor]:
        """The parameter tensors this rank holds (stages 0-2: the replicated flat buffer)."""
        return [self.flat_params]

    def _grad_storage(self) -> list[torch.Tensor]:
        """The gradient tensors this rank holds (stages 2/3 add their buckets in flight)."""
        return [self.grad_home]

    def _reduce_grads(self) -> torch.Tensor:
        """Average this step's gradients over the group; returns what AdamW updates the master with."""
        raise NotImplementedError

    def _zero_grads(self) -> None:
        if self.overlapped is not None:
            self.overlapped.reset()
        self.grad_home.zero_()

    def _publish_params(self) -> None:
        """Make the module's parameters reflect the updated master weights."""
        raise NotImplementedError
