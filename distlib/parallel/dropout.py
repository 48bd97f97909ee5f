"""Dropout masks that do not depend on the layout.

A mask drawn from a rank's RNG stream depends on which rank draws it and on what that rank drew
before: the context-parallel ranks of one data-parallel group shared a stream, a pipeline stage
drew only its own layers' masks, and a tensor-parallel rank drew masks for heads it does not
hold. Here every mask is a function of where it falls in the global computation instead:

    (seed, global sample, layer, site)  ->  a generator of its own  ->  the sample's whole mask
                                             over the site's global shape (``full``)

and a rank keeps its part of that mask by global index (its heads, its token positions). The
global sample number (``GlobalBatches``: step t reads samples [t x G, (t + 1) x G)) already says
the step and the place in the global batch, so a resumed run, a rollback and any layout draw the
same mask for the same element; no RNG state is involved.

The mask is drawn as ``F.dropout`` draws its noise (``bernoulli_(1 - p)`` in the activations'
dtype, then divided by 1 - p) and multiplied in: per element the same arithmetic as
``F.dropout`` with that noise. Every rank draws the whole per-sample mask and indexes it, so a
rank that holds a part draws more than it keeps (tensor parallelism: tp times the attention
weights' draws; docs/parallelism.md gives the cost).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

# What one dimension of a site's global shape keeps: all of it (None), a leading part (a slice of
# positions 0..n-1) or the global indices this rank holds (a LongTensor, in the rank's order).
Index = None | slice | Tensor


@dataclass(frozen=True)
class Draws:
    """The keys of one micro-batch's dropout masks: the run's ``seed``, the global sample number of
    each row of the batch (``samples``), the tensor-parallel ``share`` of the attention heads this
    rank computes ((index, count): heads [index x H / count, (index + 1) x H / count)), and the
    block (``layer``: -1 outside the blocks, e.g. GPT-2's embedding dropout)."""

    seed: int
    samples: tuple[int, ...]
    share: tuple[int, int] = (0, 1)
    layer: int = -1

    def of(self, samples) -> Draws:
        """These keys for a batch of the global samples ``samples``."""
        return replace(self, samples=tuple(samples))

    def at_layer(self, layer: int) -> Draws:
        return replace(self, layer=layer)

    def head_ids(self, local_heads: int, device, within: tuple[int, int] = (0, 1)) -> Tensor:
        """The global indices of this rank's ``local_heads`` heads: its tensor-parallel share, and
        ``within`` it a further (index, count) share (DeepSpeed-Ulysses' heads of a context rank)."""
        index, count = self.share
        inner, parts = within
        first = (index * parts + inner) * local_heads
        return torch.arange(first, first + local_heads, device=device)

    def key(self, sample: int, site: str) -> int:
        """The generator seed of one sample's mask at one site: 63 bits of a hash of the four keys."""
        text = f"{self.seed}/{sample}/{self.layer}/{site}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1

    def noise(self, site: str, p: float, full: Sequence[int], index: Sequence[Index], like: Tensor) -> Tensor:
        """(batch, *kept) factors, 0 or 1 / (1 - p), in ``like``'s dtype and device: for each row of
        the batch, its sample's mask over ``full`` kept at ``index`` (one entry per dimension)."""
        if not self.samples:  # an empty batch: no rows, of the kept shape
            return _keep(torch.empty(tuple(full), dtype=like.dtype, device=like.device), index)[None][:0]
        rows = []
        for sample in self.samples:
            keep = torch.empty(tuple(full), dtype=like.dtype, device=like.device)
            if not keep.is_meta:  # (the planner's forward on the meta device draws nothing)
                generator = torch.Generator(device=like.device)
                generator.manual_seed(self.key(sample, site))
                keep.bernoulli_(1 - p, generator=generator)
            rows.append(_keep(keep, index))
        return torch.stack(rows).div_(1 - p)

    def apply(self, x: Tensor, p: float, site: str, full: Sequence[int], index: Sequence[Index]) -> Tensor:
        """``x`` (batch, *kept) with this site's dropout: x times ``noise``."""
        if x.shape[0] != len(self.samples):
            raise ValueError(f"dropout: a batch of {x.shape[0]} rows keyed by {len(self.samples)} samples")
        return x * self.noise(site, p, full, index, x)


def _keep(mask: Tensor, index: Sequence[Index]) -> Tensor:
    for dim, where in enumerate(index):
        if isinstance(where, slice):
            mask = mask[(slice(None),) * dim + (where,)]
        elif where is not None:
            mask = mask.index_select(dim, where.to(mask.device))
    return mask


def dropout(x: Tensor, p: float, training: bool, draws: Draws | None, site: str, full, index) -> Tensor:
    """Dropout of ``x`` at one site: nothing unless ``training`` with p > 0; the layout-free mask of
    ``draws`` (the trainer's), or without them ``F.dropout`` from torch's RNG, as a model called
    directly (a test, a user's loop) draws it: that mask depends on the layout."""
    if not training or p == 0:
        return x
    if draws is None:
        return torch.nn.functional.dropout(x, p, True)
    return draws.apply(x, p, site, full, index)
