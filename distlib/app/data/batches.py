"""Deterministic data: a learnable synthetic corpus and per-rank batches.

The corpus is a Markov chain with a strong favourite successor per token, so
next-token prediction has real structure and the loss falls quickly from
ln(vocab). Batches are defined *globally*: global sample k of the run is a
fixed window of the corpus (a seeded permutation per epoch), step t consumes
samples [t*G, (t+1)*G), and rank r of N takes its own disjoint contiguous
slice of them. So the data a step sees depends only on (seed, step), never on
the world size, which is what makes resume exact and world sizes comparable.
The data position saved in a checkpoint is simply the next global sample.
Batches skipped after a guard rollback (``guard.skip_batches``) shift every later
step by that many batches; the count is part of the position (``GlobalBatches.skipped``).

The token array is either the synthetic corpus, a real text file's bytes
(``distlib.app.data.tokens``) or a text's BPE tokens (``distlib.app.data.bpe_tokens``),
memory-mapped: only the windows a rank uses are read. An optional held-out tail of it
(``data.val_fraction``) never appears in a training window and is evaluated in fixed windows
(``HeldOut``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from distlib.comm.group import Comm
from distlib.parallel.context import balance, chunks
from distlib.parallel.documents import Documents
from distlib.parallel.dropout import Draws


def make_corpus(seed: int, total_tokens: int, vocab_size: int = 64, follow_prob: float = 0.9) -> np.ndarray:
    """``total_tokens`` tokens: each token is followed by its favourite successor with
    probability ``follow_prob``, otherwise by a uniformly random token."""
    if total_tokens < 2:
        raise ValueError(f"data.total_tokens must be >= 2, got {total_tokens}")
    if not 2 <= vocab_size <= 65535:
        raise ValueError(f"vocab_size must be in [2, 65535], got {vocab_size}")
    rng = np.random.default_rng(seed)
    successor = rng.permutation(vocab_size)
    follow = rng.random(total_tokens) < follow_prob
    noise = rng.integers(0, vocab_size, size=total_tokens)
    # The chain is t[0] = noise[0]; t[i] = successor[t[i-1]] if follow[i] else noise[i]. Computed
    # without a Python loop (tests/test_data.py checks it against the loop): a run of follows
    # starting at anchor a gives t[i] = successor^(i-a)(noise[a]), and a power of a permutation
    # is a step along the cycle that contains the token.
    follow[0] = False
    index = np.arange(total_tokens)
    anchor = np.maximum.accumulate(np.where(follow, 0, index))
    start = noise[anchor]
    cycles, where, cycle_len, cycle_base = _cycles(successor)
    return cycles[cycle_base[start] + (where[start] + (index - anchor)) % cycle_len[start]]


def _cycles(perm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The permutation's cycles, laid end to end: ``cycles[base[v] + (where[v] + k) % length[v]]``
    is perm applied k times to v."""
    n = len(perm)
    cycles = np.empty(n, dtype=np.int64)
    where, length, base = (np.empty(n, dtype=np.int64) for _ in range(3))
    seen = np.zeros(n, dtype=bool)
    filled = 0
    for v in range(n):
        if seen[v]:
            continue
        first = filled
        while not seen[v]:
            seen[v] = True
            cycles[filled], where[v], base[v] = v, filled - first, first
            filled += 1
            v = perm[v]
        length[cycles[first:filled]] = filled - first
    return cycles, where, length, base


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is split: ranks x micro-batches x sequences."""

    global_batch: int  # sequences per optimizer step, all ranks together
    world_size: int  # data-parallel ranks
    grad_accum: int  # micro-batches per rank per step

    def __post_init__(self) -> None:
        if self.global_batch % (self.world_size * self.grad_accum):
            raise ValueError(
                f"global batch {self.global_batch} does not divide into {self.world_size} data-parallel "
                f"rank(s) x {self.grad_accum} micro-batch(es); choose train.global_batch as a multiple "
                f"of {self.world_size * self.grad_accum}"
            )

    @property
    def micro_batch(self) -> int:
        return self.global_batch // (self.world_size * self.grad_accum)


class GlobalBatches:
    """Fixed-length windows of a token array, served as per-rank micro-batches."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        plan: BatchPlan,
        seed: int,
        source: dict | None = None,
        ends: int | None = None,
    ):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"corpus has {len(tokens)} tokens; need at least seq_len+1 = {seq_len + 1}")
        self.tokens = tokens  # any integer numpy array, a read-only memmap included; windows are copied out
        self.source = source  # what the tokens are (e.g. a text file's sha256), checked on resume
        self.ends = ends  # data.document_mask: the end-of-document token, else None (one text)
        self.seq_len = seq_len
        self.plan = plan
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // seq_len
        self.skipped = 0  # batches skipped after rollbacks (guard.skip_batches); saved in checkpoints
        self._epoch_order: tuple[int, np.ndarray] | None = None

    def _window(self, sample: int) -> int:
        epoch, index = divmod(sample, self.num_windows)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._epoch_order = (epoch, order)
        return int(self._epoch_order[1][index])

    def micro_samples(self, step: int, dp_rank: int) -> list[range]:
        """The global sample numbers of this rank's micro-batches for ``step`` (0-based)."""
        plan = self.plan
        first = step * plan.global_batch + dp_rank * plan.micro_batch * plan.grad_accum
        starts = (first + micro * plan.micro_batch for micro in range(plan.grad_accum))
        return [range(start, start + plan.micro_batch) for start in starts]

    def micro_batches(self, step: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches (inputs, targets) for ``step`` (0-based count of steps done)."""
        batches = []
        for samples in self.micro_samples(step, dp_rank):
            windows = torch.from_numpy(np.stack([self._sample(k) for k in samples]))
            batches.append((windows[:, :-1], windows[:, 1:]))
        return batches

    def _sample(self, k: int) -> np.ndarray:
        """Global sample k's seq_len + 1 tokens (a copy, int64)."""
        start = self._window(k) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def step_fields(self, step: int) -> dict:
        """What the data adds to training step ``step``'s record (a mixture: its samples per source)."""
        return {}

    def skip(self, batches: int) -> None:
        """Every later step reads ``batches`` batches further on (after a rollback)."""
        self.skipped += batches

    def batch_index(self, step: int) -> int:
        """The (0-based) global batch that training step ``step`` (1-based) reads."""
        return step - 1 + self.skipped

    def step_batches(self, step: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for training step ``step`` (1-based), past the skipped batches."""
        return self.micro_batches(self.batch_index(step), dp_rank)

    def held_batches(self, step: int, dp_rank: int, cp: Comm | None, device, draws: Draws) -> list[tuple]:
        """``step_batches`` as (inputs, targets, positions, draws, documents) of the tokens this rank
        holds, on ``device`` (``held_tokens``: all of them without context parallelism), with the
        keys of their dropout masks: ``draws`` (this rank's seed and share) for each micro-batch's
        samples, and the documents of its whole sequences (``Documents.packed``)."""
        samples = self.micro_samples(self.batch_index(step), dp_rank)
        pairs = self.step_batches(step, dp_rank)
        return [self._held(x, y, cp, device, draws.of(k)) for (x, y), k in zip(pairs, samples)]

    def _held(self, inputs, targets, cp: Comm | None, device, draws: Draws) -> tuple:
        documents = Documents.packed(inputs, self.ends, device)
        return (*held_tokens(inputs, targets, cp, device, documents), draws, documents)

    def position(self, step: int, skipped: int | None = None) -> dict:
        """The data position after ``step`` steps (and ``skipped`` batches, default: this run's), as
        saved in a checkpoint."""
        skipped = self.skipped if skipped is None else skipped
        position = {
            "next_sample": (step + skipped) * self.plan.global_batch,
            "global_batch": self.plan.global_batch,
            "seed": self.seed,
            "num_windows": self.num_windows,
        }
        if self.source is not None:
            position["source"] = self.source
        return position


def split_heldout(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out): the last ``val_fraction`` of the tokens are held out, as one contiguous
    tail, so no training window ever overlaps a validation window."""
    held = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - held], tokens[len(tokens) - held :]


class HeldOut:
    """The first ``max_windows`` non-overlapping windows of the held-out tokens, the same at
    every evaluation; rank r of N evaluates its contiguous share of them."""

    def __init__(self, tokens: np.ndarray, seq_len: int, max_windows: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.num_windows = min(max(0, (len(tokens) - 1) // seq_len), max_windows)

    def batches(self, rank: int, world_size: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(x, y) for _, x, y in self.sourced_batches(rank, world_size, batch_size)]

    def sourced_batches(self, rank: int, world_size: int, batch_size: int) -> list[tuple]:
        """``batches`` as (source, inputs, targets), no batch across two sources (``spans``)."""
        first = rank * self.num_windows // world_size
        last = (rank + 1) * self.num_windows // world_size
        out = []
        for source, lo, hi in self.spans(first, last):
            for start in range(lo, hi, batch_size):
                windows = torch.from_numpy(
                    np.stack([self.window(w) for w in range(start, min(start + batch_size, hi))])
                )
                out.append((source, windows[:, :-1], windows[:, 1:]))
        return out

    def spans(self, first: int, last: int) -> list[tuple[int, int, int]]:
        """(source, start, stop) of the windows [first, last), cut where the source changes (one
        source here)."""
        return [(0, first, last)] if last > first else []

    @property
    def sources(self) -> int:
        return 1

    def window(self, w: int) -> np.ndarray:
        """Held-out window w's seq_len + 1 tokens (a copy, int64)."""
        return np.asarray(self.tokens[w * self.seq_len : (w + 1) * self.seq_len + 1], dtype=np.int64)


def held_tokens(
    inputs: torch.Tensor, targets: torch.Tensor, cp: Comm | None, device, documents: Documents | None = None
) -> tuple:
    """(inputs, targets, positions) of the tokens this rank holds, on ``device``: all of them
    (positions None: 0..seq-1), or with context parallelism (``cp``, the group) its chunks r and
    2cp-1-r of each sequence (``distlib.parallel.context.chunks``), with packed ``documents`` the
    chunks balanced for them (``balance``), with their positions; every cp rank then holds as many
    tokens, so the mean of their mean losses is the sequence's."""
    if cp is None:
        return inputs.to(device), targets.to(device), None
    owned = balance.owned(documents, cp.size)
    held = chunks.positions(inputs.shape[1], cp.size, cp.rank, owned=owned)
    return inputs[:, held].to(device), targets[:, held].to(device), held.to(device)
