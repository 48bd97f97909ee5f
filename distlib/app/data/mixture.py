"""A mixture of sources (``data.mixture``): which source each global sample comes from.

Global sample k of the run (``batches.GlobalBatches``: step t reads samples [t G, (t+1) G)) comes
from source s(k), drawn with probability ``data.weights`` from the seed and k alone: samples are
drawn in blocks of BLOCK, block b from its own generator (seed, MIXTURE, b), each sample a uniform
number placed among the weights' cumulative sums. Its number within the source, j(k), is how many
earlier samples drew the same source (the blocks' counts are kept as they are first drawn, so
finding sample k after a resume at step t draws the t G / BLOCK blocks before it once: 1 ms a
block, measured on 2 cores, so 0.2 s for a resume 13M samples in). Source s then serves its j-th
sample as a run of one source would its global sample j
(a seeded permutation of its windows per epoch, ``SourceWindows``). Nothing depends on the world
size, the rank or what was read before, so every layout reads the same samples and a resume
continues exactly; the position is the next global sample, as without a mixture.
"""

from __future__ import annotations

import numpy as np

from distlib.app.data.batches import BatchPlan, GlobalBatches, HeldOut

BLOCK = 1 << 16  # samples drawn together
MIXTURE = 0x6D6978  # the generators' second key ("mix"), apart from the epoch permutations'


class Mixture:
    """s(k) and j(k) of every global sample k for sampling weights ``shares`` (summing to 1)."""

    def __init__(self, shares: tuple[float, ...], seed: int):
        self.shares, self.seed = tuple(shares), seed
        self._edges = np.cumsum(shares)[:-1]  # u < edges[0]: source 0, and so on
        self._before: list[np.ndarray] = [np.zeros(len(shares), dtype=np.int64)]  # counts ahead of block b
        self._block: tuple[int, np.ndarray, np.ndarray] | None = None  # (b, sources, numbers in block)

    def _draw(self, b: int) -> np.ndarray:
        u = np.random.default_rng([self.seed, MIXTURE, b]).random(BLOCK)
        return np.searchsorted(self._edges, u, side="right")

    def _of_block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each sample of block b, its number among the block's samples of that source)."""
        if self._block is None or self._block[0] != b:
            sources = self._draw(b)
            order = np.argsort(sources, kind="stable")
            firsts = np.searchsorted(sources[order], sources[order])  # the first place of each's source
            numbers = np.empty(BLOCK, dtype=np.int64)
            numbers[order] = np.arange(BLOCK) - firsts
            self._block = (b, sources, numbers)
        return self._block[1], self._block[2]

    def _counts_before(self, b: int) -> np.ndarray:
        while len(self._before) <= b:
            n = len(self._before) - 1
            drawn = np.bincount(self._draw(n), minlength=len(self.shares))
            self._before.append(self._before[-1] + drawn)
        return self._before[b]

    def locate(self, k: int) -> tuple[int, int]:
        """(s(k), j(k)) of global sample k."""
        b, i = divmod(k, BLOCK)
        sources, numbers = self._of_block(b)
        s = int(sources[i])
        return s, int(self._counts_before(b)[s] + numbers[i])

    def counts(self, first: int, stop: int) -> list[int]:
        """How many of the samples [first, stop) each source serves."""
        out = np.zeros(len(self.shares), dtype=np.int64)
        for b in range(first // BLOCK, -(-stop // BLOCK)):
            lo, hi = max(first, b * BLOCK) - b * BLOCK, min(stop, (b + 1) * BLOCK) - b * BLOCK
            out += np.bincount(self._of_block(b)[0][lo:hi], minlength=len(self.shares))
        return out.tolist()


class SourceWindows:
    """The windows of one source's tokens: its sample j is window order_e[j mod n] of epoch
    e = j div n (n windows, order_e a permutation seeded by (seed, source, e))."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, source: int):
        self.tokens, self.seq_len, self.seed, self.source = tokens, seq_len, seed, source
        self.num_windows = (len(tokens) - 1) // seq_len
        self._order: tuple[int, np.ndarray] | None = None

    def sample(self, j: int) -> np.ndarray:
        """The seq_len + 1 tokens of the source's sample j (a copy, int64)."""
        epoch, index = divmod(j, self.num_windows)
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, MIXTURE, self.source, epoch])
            self._order = (epoch, rng.permutation(self.num_windows))
        start = int(self._order[1][index]) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)


class MixedBatches(GlobalBatches):
    """``GlobalBatches`` whose global sample k is sample j(k) of source s(k): the same micro-batches,
    data position, skipped batches and held tokens, read from several sources."""

    def __init__(
        self,
        sources: list[SourceWindows],
        shares: tuple[float, ...],
        plan: BatchPlan,
        seed: int,
        identity: dict,
        ends: int | None = None,
    ):
        # (not GlobalBatches.__init__: there is no one token array; these are every field it reads)
        self.sources, self.mixture, self.ends = sources, Mixture(shares, seed), ends
        self.source, self.seq_len, self.plan, self.seed = identity, sources[0].seq_len, plan, seed
        self.num_windows = [s.num_windows for s in sources]
        self.skipped = 0

    def _sample(self, k: int) -> np.ndarray:
        s, j = self.mixture.locate(k)
        return self.sources[s].sample(j)

    def step_fields(self, step: int) -> dict:
        """``mixture``: how many of the step's global batch each source served (every rank's view)."""
        first = self.batch_index(step) * self.plan.global_batch
        return {"mixture": self.mixture.counts(first, first + self.plan.global_batch)}


class MixedHeldOut(HeldOut):
    """The held-out windows of a mixture: each source's first ones (``HeldOut`` of its held-out
    tokens), as many as its share of ``train.eval_windows`` (at least one), source after source;
    the validation loss is their mean per token, so each source weighs as it does in training."""

    def __init__(self, helds: list[np.ndarray], seq_len: int, max_windows: int, shares: tuple[float, ...]):
        # (not HeldOut.__init__: no one token array; these are every field it reads)
        self.parts = [HeldOut(t, seq_len, max(1, round(max_windows * w))) for t, w in zip(helds, shares)]
        self.seq_len = seq_len
        self.num_windows = sum(p.num_windows for p in self.parts)

    @property
    def sources(self) -> int:
        return len(self.parts)

    def spans(self, first: int, last: int) -> list[tuple[int, int, int]]:
        out, at = [], 0
        for s, part in enumerate(self.parts):
            lo, hi = max(first, at), min(last, at + part.num_windows)
            if lo < hi:
                out.append((s, lo, hi))
            at += part.num_windows
        return out

    def window(self, w: int) -> np.ndarray:
        for part in self.parts:
            if w < part.num_windows:
                return part.window(w)
            w -= part.num_windows
        raise IndexError(w)
