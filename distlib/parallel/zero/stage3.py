"""ZeRO stage 3: the parameters are sharded too, and gathered one unit at a time.

A *unit* is a top-level child of the model (the embeddings, each transformer block, the final
LayerNorm, the LM head; a ModuleList counts as its children); its parameters are one contiguous
flat range. Each rank keeps only its partition of the parameters (``param_shard``, in the compute
dtype) besides its partitions of gradients and state. A unit's parameters are views into a
unit-sized buffer whose storage is empty except while needed:

  forward pre-hook    all-gather the unit (uneven bounds: each rank contributes the
                      part of the unit inside its partition), then run it;
  forward hook        free the storage, and hook the unit's output so that
  output grad hook    the unit is gathered again just before its backward runs;
  last grad of unit   (``buckets.GradBuckets``, one bucket per unit) reduce-scatter
                      the unit's gradients into the partitions and free the storage.

Autograd saved the parameters' *views*, so refilling the same storage before backward is all it
needs. PyTorch runs a parameter's gradient accumulation as soon as it is produced, so a unit's
gradients are complete, and its storage freed, before the next unit's backward gathers: one unit
is live at a time. ``apply_update`` only copies the master partition into ``param_shard``.

Shared units (tied weights): a child whose parameters all belong to an earlier unit (a tied LM
head holds the token embedding's weight) is no unit of its own but a *user* of that one. The
shared unit is gathered at its first forward and stays gathered through its users' forwards and
the whole backward, until its gradient -- autograd sums every use's contribution before the one
accumulation -- is reduce-scattered; without gradients it is freed after its last user's
forward. It is live beside the other units (``memory_formula`` allows for it).

Prefetch (``overlap``): every collective of the group runs on the communication thread
(``comm.progress.Progress``), in the order the hooks submit it. The forward pre-hook of unit k
waits for k's gather and queues k+1's (units are numbered in forward order: the model's children),
so k+1's all-gather is in flight while k computes; in backward the hook on k's output waits for k
and queues k-1's, and k's gradient reduce-scatter and its release are queued behind it; the last
unit stays gathered from its forward to its backward where that comes next, and is released when
another forward begins first (a pipeline stage running several micro-batches' forwards in a row:
gpipe, 1f1b's warm-up; kept, it was a third unit beside the next forward's first two). Two units
(and two gradient buckets) are live at a time instead of one. An all-gather copies values, so
results are bitwise those without prefetch. ``sync_grads`` waits for the queue and then drops
any unit still gathered (a prefetch that no forward or backward used), so no stale parameters
survive the update.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distlib.comm import collectives
from distlib.parallel.zero.base import StageOptimizer
from distlib.parallel.zero.buckets import Bucket, GradBuckets, contiguous_bucket
from distlib.parallel.zero.units import unit_members


class Stage3Optimizer(StageOptimizer):
    stage = 3

    def _init_storage(self, fp32_flat: torch.Tensor) -> None:
        self.param_shard = fp32_flat[self.my_range].to(self.param_dtype, copy=True)
        self._partitioned_state(fp32_flat)
        members = unit_members(self.module, self.params)
        units = [m for m, owner in members if owner is None]
        users: dict[int, list[nn.Module]] = {}  # unit -> the later modules that use its parameters
        for m, owner in members:
            if owner is not None:
                users.setdefault(owner, []).append(m)
        self._shared = set(users)
        index = {id(p): i for i, p in enumerate(self.params)}
        # One bucket per unit: its gradients are reduced, and its storage freed, together.
        self.units: list[Bucket] = [
            contiguous_bucket(
                [tuple(index[id(p)] for p in u.parameters() if id(p) in index)], self.layout.slots
            )
            for u in units
        ]
        self.grads = GradBuckets(
            self.layout,
            self.params,
            self.comm,
            self.units,
            self._sample_memory,
            reduced=self._release,
            progress=self.progress,
        )
        self.grad_home = self.grads.partition
        self._gathered = [False] * len(self.units)  # gathered, or (overlap) its gather is queued
        self._gathering: list = [None] * len(self.units)  # (overlap) the queued gather's Ticket
        self._backward_seen: set[int] = set()  # units whose backward began since their forward
        self._kept: int | None = None  # (overlap) the last unit, kept gathered for its backward
        self._unit_buffers = []
        for b, (unit, module) in enumerate(zip(self.units, units)):
            full = torch.empty(unit.numel, dtype=self.param_dtype, device=self.device)
            for i in unit.params:
                slot = self.layout.slots[i]
                start = slot.offset - unit.lo
                self.params[i].data = full[start : start + slot.numel].view(slot.shape)
            full.untyped_storage().resize_(0)
            self._unit_buffers.append(full)
            module.register_forward_pre_hook(lambda m, args, b=b: self._before_forward(b))
            module.register_forward_hook(lambda m, args, out, b=b: self._after_forward(b, out))
        for b, later in users.items():
            for m in later:
                m.register_forward_pre_hook(lambda m, args, b=b: self._gather(b))
            later[-1].register_forward_hook(lambda m, args, out, b=b: self._after_last_use(b, out))

    def _param_storage(self) -> list[torch.Tensor]:
        return [self.param_shard] + self._unit_buffers

    def _grad_storage(self) -> list[torch.Tensor]:
        return self.grads.live()

    # -- gather / free --------------------------------------------------------------
    @torch.no_grad()
    def _fill(self, b: int) -> None:
        """Give unit ``b`` its storage back and all-gather its parameters into it."""
        unit, full = self.units[b], self._unit_buffers[b]
        full.untyped_storage().resize_(unit.numel * full.element_size())
        bounds = self.layout.bounds_within(unit.lo, unit.hi)
        a, z = bounds[self.comm.rank]
        start = unit.lo + a - self.my_range.start
        collectives.all_gather(full, self.param_shard[start : start + (z - a)], self.comm, bounds=bounds)

    def _free(self, b: int) -> None:
        self._unit_buffers[b].untyped_storage().resize_(0)

    def _gather(self, b: int) -> None:
        """Unit ``b``'s parameters, ready now (waits for a prefetch, or gathers)."""
        if self._gathered[b]:
            ticket, self._gathering[b] = self._gathering[b], None
            if ticket is not None:
                ticket.wait()
                self._sample_memory()
            return
        self._gathered[b] = True
        if self.progress is None:
            self._fill(b)
        else:
            self.progress.submit(self._fill, b).wait()
        self._sample_memory()  # here, never on the thread: it reads .grad, which backward rewrites

    def _prefetch(self, b: int) -> None:
        if 0 <= b < len(self.units) and not self._gathered[b]:
            self._gathered[b] = True
            self._gathering[b] = self.progress.submit(self._fill, b)

    def _release(self, b: int) -> None:
        self._gathered[b] = False
        if self.progress is None:
            self._free(b)
        else:
            self.progress.submit(self._free, b)  # behind what still reads the unit

    def _before_forward(self, b: int) -> None:
        self._backward_seen.discard(b)
        if self._kept is not None and b != self._kept:  # another forward came before its backward
            self._release(self._kept)
            self._kept = None
        self._gather(b)
        if self.progress is not None:
            self._prefetch(b + 1)

    def _before_backward(self, b: int) -> None:
        self._backward_seen.add(b)
        if b == self._kept:
            self._kept = None
        self._gather(b)
        if self.progress is not None and b - 1 not in self._backward_seen:
            self._prefetch(b - 1)

    def _after_forward(self, b: int, out) -> None:
        grads = isinstance(out, torch.Tensor) and out.requires_grad
        # (overlap: the last unit stays, its backward may come next; a shared unit stays for its later users)
        keep = grads and self.progress is not None and b == len(self.units) - 1
        if b not in self._shared and keep:
            self._kept = b
        elif b not in self._shared:
            self._release(b)
        if grads:
            out.register_hook(lambda grad: self._before_backward(b))

    def _after_last_use(self, b: int, out) -> None:
        """The last module using shared unit ``b`` ran: without gradients the unit is freed now; with
        them it stays gathered from its first use to its gradient's reduce-scatter (``_release``),
        which comes after its first user's backward, the last of its uses."""
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            self._release(b)

    # -- the step -------------------------------------------------------------------
    def _reduce_grads(self) -> torch.Tensor:
        partition = self.grads.collect(self.stage)
        # The queue is empty now: drop unused prefetches (and a shared unit of a forward without backward).
        for b, gathered in enumerate(self._gathered):
            if gathered:
                self._gathered[b], self._gathering[b] = False, None
                self._free(b)
        self._kept = None
        self._sample_memory()
        return partition

    def _publish_params(self) -> None:
        self.param_shard.copy_(self.master)

    def param_squares(self) -> torch.Tensor:
        return self.norms.squares_of_partition(self.param_shard)

    @property
    def param_buffer(self) -> torch.Tensor:
        return self.param_shard

    @property
    def param_buffer_start(self) -> int:
        return self.my_range.start

    @torch.no_grad()
    def full_params(self) -> torch.Tensor:
        """A gathered copy of every partition (a temporary bP, outside the step's memory peak)."""
        if self.progress is not None:
            self.progress.drain()
        full = torch.empty(self.layout.padded_numel, dtype=self.param_dtype, device=self.device)
        collectives.all_gather(full, self.param_shard, self.comm)
        return full

    def memory_formula(self) -> dict[str, tuple[float, float, str]]:
        """params bP/N, grads 4P/N, Adam 12P/N; the allowances are what ``predict`` says the
        gathered units (one, beside a unit shared by later modules: tied weights; with prefetch
        the next one too) and the gradient buckets add at their peak, with the padded tail."""
        s = self._sizes()
        peaks = self._predicted_peaks()
        shared = " + shared unit" if self._shared else ""
        return {
            "params": (s.b * s.p / s.n, peaks.params - s.b * s.p / s.n, f"{s.b}P/N + unit{shared}"),
            "grads": (4 * s.p / s.n, peaks.grads - 4 * s.p / s.n, "4P/N + unit"),
            "optimizer": (12 * s.p / s.n, 12 * s.pad / s.n, "12P/N"),
        }
