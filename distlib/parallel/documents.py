"""Packed documents: attention that stays inside each document of a training sequence.

A training sequence is a window of a token stream in which every document ends with an
end-of-document token, so one sequence holds the tail of one document, whole ones, and the head of
the next. ``Documents`` records, for whole sequences, the position at which each token's document
starts; everything a layer needs is derived from it:

- the mask of any (query, key) positions: the key is attended when it lies in [start of the query's
  document, query] -- causal and within one document (documents are contiguous, so that interval is
  exactly the query's document up to the query);
- the positions within documents (``within``): they restart at 0 at each document's first token,
  so a packed document computes what it would alone;
- the first document start among each chunk's queries (``chunk_starts``): the ring skips a block
  of keys that ends before it (no query there reaches it), and pairs the chunks by what is left
  (``distlib.parallel.context.balance``).

A rank that holds part of a sequence (context parallelism) keeps the starts of the whole sequence
(one integer per token), so any of its layers can index them by the positions it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class Documents:
    starts: Tensor  # (batch, seq_len) int64: the position where each token's document starts
    # what every layer of a forward derives alike (the whole mask, the chunks' first starts), kept
    # once: otherwise each attention rebuilds the (batch, seq, seq) mask and the ring reads the
    # chunks' starts back to the host again, per layer
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of_tokens(cls, tokens: Tensor, end: int) -> Documents:
        """The documents of ``tokens`` (batch, seq_len): one starts at position 0 and after every
        ``end`` token (the end token is its own document's last)."""
        batch, seq = tokens.shape
        index = torch.arange(seq, dtype=torch.int64, device=tokens.device).expand(batch, seq)
        first = torch.zeros((batch, seq), dtype=torch.bool, device=tokens.device)
        first[:, 1:] = tokens[:, :-1] == end
        return cls(torch.cummax(torch.where(first, index, 0), dim=1).values)

    @classmethod
    def packed(cls, tokens: Tensor, end: int | None, device) -> Documents | None:
        """``of_tokens`` on ``device``, or None without an end token (no document masks)."""
        return None if end is None else cls.of_tokens(tokens, end).to(device)

    def to(self, device) -> Documents:
        return Documents(self.starts.to(device))

    @property
    def seq_len(self) -> int:
        return self.starts.shape[1]

    def within(self, positions: Tensor) -> Tensor:
        """Where the tokens at ``positions`` (seq,) sit in their documents: (batch, seq)."""
        return positions[None, :] - self.starts[:, positions]

    def mask(self, queries: Tensor, keys: Tensor) -> Tensor:
        """True where the query may attend the key, (batch, 1, len(queries), len(keys)): the key is
        in the query's document, at or before it. ``queries`` and ``keys``: sequence positions."""
        first = self.starts[:, queries][:, :, None]
        k = keys[None, None, :]
        return ((k <= queries[None, :, None]) & (k >= first))[:, None]

    def whole_mask(self) -> Tensor:
        """``mask`` of the whole sequences (every position against every position)."""
        if "whole" not in self._derived:
            every = torch.arange(self.seq_len, device=self.starts.device)
            self._derived["whole"] = self.mask(every, every)
        return self._derived["whole"]

    def chunk_starts(self, chunk: int) -> list[int]:
        """The first document start among the queries of each ``chunk``-token chunk of the sequence,
        over the batch (one host read): a key chunk that ends before it is seen by none of them."""
        key = ("chunk_starts", chunk)
        if key not in self._derived:
            batch = self.starts.shape[0]
            self._derived[key] = self.starts.view(batch, -1, chunk).amin(dim=(0, 2)).tolist()
        return self._derived[key]
