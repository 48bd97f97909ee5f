"""Which two chunks each context-parallel rank holds when packed documents make pairs free.

The ring attends a (query chunk, key chunk) pair when the key chunk is not in the query chunk's
future and ends after the first document start among the query chunk's tokens (``ring_blocks``):
query chunk c of 2N costs ``c - first_c // chunk + 1`` pairs (``chunk_work``). Causal attention
alone costs c + 1, which the zig-zag pairs balance exactly (``chunks``); with documents the costs
fall unevenly (rank 0's early chunk reaches no chunk before it: benchmarks/ring_documents.py
measured the busiest rank at up to 1.40x the mean over 20 draws, 2.0x in one).

A rank's work is the sum of its two chunks', and the ring runs in lock-step, so the busiest rank's
sum is the step's. ``balanced`` pairs the cheapest chunk with the dearest, the second cheapest
with the second dearest, and so on: no pairing has a smaller busiest sum (if the cheapest chunk
a were paired with some b while the dearest d went with c, swapping to (a, d) and (b, c) raises
neither maximum, as a + d <= c + d and b + c <= c + d; repeat on what is left). Ties go by chunk
index, so causal costs give back the zig-zag exactly, and rank r takes the pair of the r-th
cheapest chunk. Every rank derives the same pairs from the same documents (the whole sequences'
starts, which every rank keeps), so nothing is exchanged.
"""

from __future__ import annotations

from distlib.parallel.context.chunks import Owned
from distlib.parallel.documents import Documents


def chunk_work(firsts: list[int], chunk: int) -> list[int]:
    """The pairs each query chunk attends over the whole ring, given its first document start."""
    return [c - first // chunk + 1 for c, first in enumerate(firsts)]


def balanced(work: list[int]) -> Owned:
    """Each rank's two chunks (early one first) for the chunks' ``work``: the cheapest with the
    dearest, and so on; rank r holds the pair of the r-th cheapest chunk."""
    if len(work) % 2:
        raise ValueError(f"balanced: {len(work)} chunks do not pair up")
    order = sorted(range(len(work)), key=lambda c: (work[c], c))
    pairs = zip(order[: len(work) // 2], reversed(order[len(work) // 2 :]))
    return tuple((min(a, b), max(a, b)) for a, b in pairs)


def owned(documents: Documents | None, cp: int) -> Owned | None:
    """The chunks each of ``cp`` ranks holds for sequences of ``documents``: balanced for their
    work; None without documents (the zig-zag)."""
    if documents is None or cp == 1:
        return None
    chunk = documents.seq_len // (2 * cp)
    return balanced(chunk_work(documents.chunk_starts(chunk), chunk))
