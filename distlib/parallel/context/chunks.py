"""Which tokens of a sequence a context-parallel rank holds: chunks r and 2N - 1 - r of 2N.

With causal attention, the query in chunk c attends c + 1 chunks of keys; pairing chunk r with
chunk 2N - 1 - r gives every rank (r + 1) + (2N - r) = 2N + 1 chunk pairs, the same on every rank
(Megatron's zig-zag; torchtitan's head-tail). A contiguous split would give the last rank 2N - 1
times the first one's.

Packed documents make some pairs free (no query of a chunk reaches a key chunk before its first
document), so the zig-zag pairs no longer balance the work: ``balance`` then pairs the chunks
anew for each micro-batch, and every function here takes that assignment (``owned``: each rank's
two chunks, the early one first; None: the zig-zag's).
"""

from __future__ import annotations

import torch


def chunk_bounds(seq_len: int, cp: int) -> list[tuple[int, int]]:
    """The 2 x cp equal chunks of a sequence, as (start, end); seq_len must divide evenly."""
    if seq_len % (2 * cp):
        raise ValueError(f"model.seq_len={seq_len} must be divisible by 2 x dist.cp = {2 * cp}")
    size = seq_len // (2 * cp)
    return [(c * size, (c + 1) * size) for c in range(2 * cp)]


Owned = tuple[tuple[int, int], ...]  # each rank's two chunks, early one first


def zigzag(cp: int) -> Owned:
    """Chunks r and 2 cp - 1 - r for every rank r: the assignment without documents."""
    return tuple((r, 2 * cp - 1 - r) for r in range(cp))


def rank_chunks(cp: int, rank: int, owned: Owned | None = None) -> tuple[int, int]:
    """The two chunks context-parallel rank ``rank`` holds, early one first."""
    return owned[rank] if owned is not None else (rank, 2 * cp - 1 - rank)


def positions(
    seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu", owned: Owned | None = None
) -> torch.Tensor:
    """The positions (in the whole sequence) of the tokens ``rank`` holds, in the order it holds
    them: its early chunk, then its late one."""
    bounds = chunk_bounds(seq_len, cp)
    return torch.cat([torch.arange(*bounds[c], device=device) for c in rank_chunks(cp, rank, owned)])


def gathered(seq_len: int, cp: int, device: torch.device | str = "cpu", owned: Owned | None = None):
    """(held, natural_order): every rank's positions concatenated in rank order, and the
    permutation that puts tokens gathered so back into sequence order (``gathered[:, order]`` is
    the sequence; ``sequence[:, held]`` is the gathered order)."""
    held = torch.cat([positions(seq_len, cp, r, device, owned) for r in range(cp)])
    return held, torch.argsort(held)
