"""Runs of consecutive elements: how the relayout plans in memory that grows with the number of
contiguous pieces, not of elements.

A tensor-parallel piece (``shard_of``) is, in the global row-major order of its parameter, a few
runs: one per group for a cut along dim 0 (the fused q|k|v: 3), one per row for a cut along the
last dim. A rank's partition of a flat layout is one window of each piece's positions. So "which
saved element goes where" is a short list of (global start, position, length) triples, and
matching what a rank wants with what a holding has is an intersection of two sorted lists of
intervals. Planning by element index instead took 8 bytes an element for each of several index
vectors: 4.2 GB apiece for one 8B model's 525M-element embedding.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from distlib.parallel.tensor_parallel import Split

HOST = torch.device("cpu")
LONG_RUN = 1 << 16  # copied as a slice; shorter runs are expanded to indices, BATCH elements at a time
BATCH = 1 << 22  # 4M elements: 64 MB of index vectors at most


def _long(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long, device=HOST)


@dataclass(frozen=True)
class Runs:
    """Run k covers ``length[k]`` elements from key ``start[k]`` on, placed from ``at[k]`` on; sorted by
    ``start``, disjoint in it, no run empty."""

    start: torch.Tensor
    at: torch.Tensor
    length: torch.Tensor

    @staticmethod
    def of(start, at, length) -> Runs:
        """Runs from any int sequences, the empty ones left out."""
        start, at, length = _long(start), _long(at), _long(length)
        if bool((length > 0).all()):
            return Runs(start, at, length)
        keep = length > 0
        return Runs(start[keep], at[keep], length[keep])

    def __len__(self) -> int:
        return self.start.numel()

    @property
    def numel(self) -> int:
        return int(self.length.sum())

    def shifted(self, by: int) -> Runs:
        return Runs(self.start, self.at + by, self.length)

    def window(self, lo: int, hi: int) -> Runs:
        """The part of each run whose positions ``at`` fall in [lo, hi)."""
        a = self.at.clamp(min=lo)
        b = (self.at + self.length).clamp(max=hi)
        return Runs.of(self.start + (a - self.at), a, b - a)


def _none() -> Runs:
    return Runs.of([], [], [])


def _one(numel: int) -> Runs:
    """A whole tensor of ``numel`` elements: one run (none if empty)."""
    return Runs.of([0], [0], [numel])


def _chunk_span(lo: int, size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of ``torch.chunk``'s ``index``-th of ``parts`` of ``size`` elements from ``lo``."""
    step = -(-size // parts) if size else 0
    return lo + min(index * step, size), lo + min((index + 1) * step, size)


@functools.lru_cache(maxsize=1024)  # a model has few distinct (shape, cut)s; its layers repeat them
def piece_runs(shape: tuple[int, ...], split: Split | None) -> Runs:
    """The runs of the piece ``split`` cuts from a tensor of ``shape``: start = the global row-major
    index, at = the position in the piece (``shard_of``'s order). (Shared: runs are never changed
    in place.)"""
    numel = math.prod(shape)
    if split is None:
        return _one(numel)
    d, n = split.dim, shape[split.dim]
    outer, inner = math.prod(shape[:d]), math.prod(shape[d + 1 :])
    spans = []
    for g in range(split.groups):
        g_lo, g_hi = _chunk_span(0, n, split.groups, g)
        spans.append(_chunk_span(g_lo, g_hi - g_lo, split.parts, split.index))
    width = sum(hi - lo for lo, hi in spans)
    before = [sum(hi - lo for lo, hi in spans[:g]) for g in range(len(spans))]
    o = torch.arange(outer, device=HOST)[:, None]
    start = o * n * inner + _long([lo for lo, _ in spans]) * inner
    at = o * width * inner + _long(before) * inner
    length = (_long([hi - lo for lo, hi in spans]) * inner).expand(outer, -1)
    return Runs.of(start.reshape(-1), at.reshape(-1), length.reshape(-1))


def _find(runs: Runs, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the run holding each point, whether one does)."""
    k = torch.searchsorted(runs.start, points, right=True) - 1
    safe = k.clamp(min=0)
    return safe, (k >= 0) & (points < runs.start[safe] + runs.length[safe])


def _within(runs: Runs, lo: int, hi: int) -> bool:
    """Whether every run lies in [lo, hi) (runs sorted by start)."""
    return int(runs.start[0]) >= lo and int(runs.start[-1] + runs.length[-1]) <= hi


def intersect(want: Runs, have: Runs) -> tuple[Runs, Runs]:
    """(matched, left): ``want``'s elements that ``have`` covers, as runs with start = their position
    in ``have`` and at = their position in ``want``; and the rest of ``want``, as ``want`` runs."""
    if not len(want) or not len(have):
        return _none(), want
    if len(have) == 1 and _within(want, int(have.start[0]), int(have.start[0] + have.length[0])):
        # the common case (a whole parameter, or a piece holding all a rank wants): one shift
        return Runs(want.start - have.start[0] + have.at[0], want.at, want.length), _none()
    points = torch.cat([want.start, want.start + want.length, have.start, have.start + have.length])
    points = points.unique(sorted=True)
    p, length = points[:-1], points[1:] - points[:-1]
    w, in_want = _find(want, p)
    h, in_have = _find(have, p)
    at = want.at[w] + (p - want.start[w])
    mine = in_want & in_have
    src = have.at[h[mine]] + (p[mine] - have.start[h[mine]])
    rest = in_want & ~in_have
    return Runs.of(src, at[mine], length[mine]), Runs.of(p[rest], at[rest], length[rest])


def by_partition(runs: Runs, size: int) -> dict[int, Runs]:
    """Runs whose start is a position in a vector partitioned into ``size``-element parts, cut at
    the parts' edges: part -> runs with start = the offset in that part."""
    if not len(runs):
        return {}
    if _within(runs, size * (int(runs.start[0]) // size), size * (int(runs.start[0]) // size + 1)):
        d = int(runs.start[0]) // size  # all in one part (the common case)
        return {d: Runs(runs.start - d * size, runs.at, runs.length)}
    first = runs.start // size
    count = (runs.start + runs.length - 1) // size - first + 1
    k = torch.repeat_interleave(torch.arange(len(runs), device=HOST), count)
    nth = torch.arange(k.numel(), device=HOST) - torch.repeat_interleave(count.cumsum(0) - count, count)
    part = first[k] + nth
    lo = torch.maximum(runs.start[k], part * size)
    hi = torch.minimum(runs.start[k] + runs.length[k], (part + 1) * size)
    out = {}
    for d in part.unique().tolist():
        at = part == d
        out[d] = Runs.of(lo[at] - d * size, runs.at[k][at] + (lo[at] - runs.start[k][at]), (hi - lo)[at])
    return out


def concat(parts: list[Runs]) -> Runs:
    """One list of runs from several (whose starts are disjoint); sorted by start."""
    if len(parts) == 1:
        return parts[0]
    start, at, length = (torch.cat([getattr(r, f) for r in parts]) for f in ("start", "at", "length"))
    order = start.argsort()
    return Runs(start[order], at[order], length[order])


def _expand(start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Every index of every run, run by run."""
    total = int(length.sum())
    skip = torch.repeat_interleave(start - (length.cumsum(0) - length), length)
    return skip + torch.arange(total, device=HOST)


def copy(out: torch.Tensor, source: torch.Tensor, runs: Runs, base: int = 0) -> None:
    """out[at : at + length] = source[start - base : ...] for every run: long runs as slices, the
    rest as index vectors of at most BATCH elements."""
    long = runs.length >= LONG_RUN
    for s, a, n in zip(runs.start[long].tolist(), runs.at[long].tolist(), runs.length[long].tolist()):
        out[a : a + n] = source[s - base : s - base + n]
    start, at, length = runs.start[~long], runs.at[~long], runs.length[~long]
    if not start.numel():
        return
    batch = (length.cumsum(0) - length) // BATCH
    for b in batch.unique().tolist():
        mine = batch == b
        out[_expand(at[mine], length[mine])] = source[_expand(start[mine] - base, length[mine])]
