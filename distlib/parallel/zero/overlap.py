"""Stages 0/1 with ``overlap``: the gradient sync starts from backward hooks, bucket by bucket.

The flat fp32 gradient buffer (``flat_grads``) is cut into buckets of whole modules in backward
order (``buckets.buckets_by_size``). A post-accumulate-grad hook on every parameter (registered
after ``flat_grads``' own, so in bf16 the gradient is already added in) notes its arrival; when the
last gradient of a bucket has arrived in the ``accum``-th backward since the last step -- the last
micro-batch, as DDP's ``no_sync`` leaves it -- the bucket's collective is handed to the
communication thread (``comm.progress.Progress``) and runs while backward computes the next
buckets: stage 0 all-reduces the bucket in place (avg), stage 1 reduce-scatters it straight into
the ranks' partitions (uneven bounds, as stage 2's buckets). ``finish`` launches any bucket that
did not complete (fewer backwards than ``accum``, a parameter without a gradient), waits for all of
them and returns what the non-overlapped path returns: the averaged flat buffer (stage 0) or this
rank's averaged partition (stage 1). The padded tail of the buffer belongs to no bucket: it holds
zeros, whose average is zero.

Not bitwise equal to the one-call sync in general: a collective's algorithm (and so the order in
which the N contributions are added) is chosen by the size of what it reduces, and a bucket is
smaller than the buffer. Each element is still reduced once, by one algorithm, identically on
every rank, so the replicas stay bitwise equal to each other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distlib.comm import collectives
from distlib.comm.group import Comm
from distlib.comm.progress import Progress, Ticket
from distlib.parallel.flat_layout import FlatLayout
from distlib.parallel.zero.buckets import Bucket


class OverlappedSync:
    """Buckets of ``flat_grads`` synchronised from backward hooks on ``progress``'s thread."""

    def __init__(
        self,
        layout: FlatLayout,
        params: Sequence[torch.Tensor],
        flat_grads: torch.Tensor,
        comm: Comm,
        buckets: list[Bucket],
        progress: Progress,
        *,
        scatter: bool,
        accum: int = 1,
    ):
        if accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {accum}")
        self.layout, self.flat, self.comm, self.buckets = layout, flat_grads, comm, buckets
        self.progress, self.scatter, self.accum = progress, scatter, accum
        self._bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket.params}
        self._arrived: list[set[int]] = [set() for _ in buckets]
        self._completed = [0] * len(buckets)  # backwards that filled the bucket, this step
        self._tickets: list[Ticket | None] = [None] * len(buckets)
        self._partition: torch.Tensor | None = None
        self.launch_log: list[int] = []  # buckets in launch order (tests read it)
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def _hook(self, index: int):
        def hook(p: torch.Tensor) -> None:
            b = self._bucket_of[index]
            if self._tickets[b] is not None:
                raise RuntimeError(
                    f"gradient of {self.layout.slots[index].name} arrived after its bucket's sync "
                    f"started: more backward passes than grad_accum={self.accum} before the step"
                )
            self._arrived[b].add(index)
            if len(self._arrived[b]) == len(self.buckets[b].params):
                self._arrived[b] = set()
                self._completed[b] += 1
                if self._completed[b] == self.accum:
                    self._launch(b)

        return hook

    def _launch(self, b: int) -> None:
        if self._partition is None and self.scatter:
            self._partition = torch.zeros(self.layout.shard_numel, device=self.flat.device)
        self.launch_log.append(b)
        self._tickets[b] = self.progress.submit(self._reduce, self.buckets[b])

    @torch.no_grad()
    def _reduce(self, bucket: Bucket) -> None:  # on the communication thread
        view = self.flat[bucket.lo : bucket.hi]
        if not self.scatter:
            collectives.all_reduce(view, self.comm, op="avg")
            return
        bounds = self.layout.bounds_within(bucket.lo, bucket.hi)
        mine = collectives.reduce_scatter(view, self.comm, op="avg", bounds=bounds)
        a, z = bounds[self.comm.rank]
        if z > a:
            start = bucket.lo + a - self.layout.shard_range(self.comm.rank)[0]
            self._partition[start : start + (z - a)].copy_(mine)

    @property
    def in_flight(self) -> bool:
        return any(t is not None for t in self._tickets)

    def finish(self) -> torch.Tensor:
        """Launch what is left, wait for every bucket, and return the averaged gradients."""
        for b, ticket in enumerate(self._tickets):
            if ticket is None:
                self._launch(b)
        self.progress.drain()
        partition = self._partition
        self.reset()
        return partition if self.scatter else self.flat

    def reset(self) -> None:
        """Forget this step's arrivals (``zero_grad``); waits for anything still in flight first."""
        if self.in_flight:
            self.progress.drain()
        self._arrived = [set() for _ in self.buckets]
        self._completed = [0] * len(self.buckets)
        self._tickets = [None] * len(self.buckets)
        self._partition = None
