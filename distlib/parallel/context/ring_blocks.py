"""Which blocks of a ring a rank attends, and where their rows, keys and masks are.

The ``chunks`` layout gives every rank two chunks of each sequence; at ring step s a rank holds the
keys of rank (r - s) mod N. ``step_blocks`` pairs its query chunks with the key chunks they see
causally (a key chunk entirely in the query chunk's future is never computed); ``Layout`` maps a
block to rows and sequence positions, its mask, its dropout factors, and with documents
(``distlib.parallel.documents``) drops the key chunks that end before every document of the query
chunk starts; the chunks a rank holds are then ``balance``'s pairs for those documents.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from distlib.comm.group import Comm
from distlib.parallel.context import balance, chunks
from distlib.parallel.documents import Documents

# (local query chunk, first key chunk, end key chunk, needs a mask): key chunks in held order.
Block = tuple[int, int, int, bool]


@dataclass
class RingStats:
    """(query chunk, key chunk) pairs this rank attended, forward and backward: the balance."""

    forward_blocks: int = 0
    backward_blocks: int = 0


def step_blocks(cp: int, rank: int, src: int, owned: chunks.Owned | None = None) -> list[Block]:
    """The pairs ``rank``'s queries attend in ``src``'s keys. A key chunk before the query chunk
    is entirely visible, the same chunk needs the causal mask, a later one is skipped; chunks are
    held in increasing order, so the keys needed are always a prefix of the block."""
    keys = chunks.rank_chunks(cp, src, owned)
    found = []
    for a, qc in enumerate(chunks.rank_chunks(cp, rank, owned)):
        needed = [kc for kc in keys if kc <= qc]
        if needed:
            found.append((a, 0, len(needed), qc in needed))
    return found


def block_count(cp: int, rank: int) -> int:
    """(query chunk, key chunk) pairs ``rank`` attends over the whole ring in the zig-zag layout
    (causal attention)."""
    return sum(b1 - b0 for s in range(cp) for _, b0, b1, _ in step_blocks(cp, rank, (rank - s) % cp))


class Layout:
    """Where a rank's rows are: two chunks of ``chunk`` tokens; the positions of any rank's. With
    ``documents`` the ranks hold ``balance``'s chunks for them, and ``positions`` must be those."""

    def __init__(self, comm: Comm, positions: Tensor, local_len: int, documents: Documents | None = None):
        if local_len % 2 or positions.shape != (local_len,):
            raise ValueError(f"ring_attention: {local_len} local tokens need 2 chunks and as many positions")
        self.comm, self.n, self.me = comm, comm.size, comm.rank
        self.chunk, self.positions, self.documents = local_len // 2, positions, documents
        self.owned = balance.owned(documents, self.n)
        # documents: each chunk's first document start, which decides the blocks no query reaches
        self.firsts = None if documents is None else documents.chunk_starts(self.chunk)
        # with documents a row may see no key of a computed block: its partial is empty (ring)
        self.empty_rows = documents is not None

    def blocks(self, src: int) -> list[Block]:
        """The pairs this rank's queries attend in ``src``'s keys (``step_blocks``); with documents,
        less each key chunk that ends before every document of the query chunk starts."""
        found = step_blocks(self.n, self.me, src, self.owned)
        if self.firsts is None:
            return found
        keys = chunks.rank_chunks(self.n, src, self.owned)
        held = chunks.rank_chunks(self.n, self.me, self.owned)
        kept = []
        for a, b0, b1, _ in found:
            reached = [b for b in range(b0, b1) if (keys[b] + 1) * self.chunk > self.firsts[held[a]]]
            if reached:  # later key chunks end later: the reached ones are a tail of the block
                kept.append((a, reached[0], reached[-1] + 1, True))
        return kept

    def rows(self, first: int, end: int) -> slice:
        return slice(first * self.chunk, end * self.chunk)

    def key_positions(self, blk: Block, src: int) -> Tensor:
        """The sequence positions of ``blk``'s keys in ``src``'s block."""
        seq_len = 2 * self.n * self.chunk
        held = chunks.positions(seq_len, self.n, src, self.positions.device, self.owned)
        return held[self.rows(blk[1], blk[2])]

    def mask(self, blk: Block, src: int) -> Tensor | None:
        """True where the key may be attended (key position <= query position, and with documents
        in the query's document), for the pairs of ``blk`` with ``src``'s keys; None where every pair
        is entirely visible."""
        a, _, _, masked = blk
        if not masked:
            return None
        queries, keys = self.positions[self.rows(a, a + 1)], self.key_positions(blk, src)
        if self.documents is not None:  # (batch, 1, queries, keys): within the query's document too
            return self.documents.mask(queries, keys)
        return keys[None, :] <= queries[:, None]

    def factors(self, dropout: Tensor | None, blk: Block, src: int) -> Tensor | None:
        """The dropout factors of ``blk``'s (query, key) pairs with ``src``'s keys (None: no dropout)."""
        if dropout is None:
            return None
        a = blk[0]
        return dropout[..., self.rows(a, a + 1), :].index_select(-1, self.key_positions(blk, src))
