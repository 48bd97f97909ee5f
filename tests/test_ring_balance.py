"""The chunks a context-parallel rank holds with packed documents (distlib/parallel/context/balance.py;
issue 39 item 4): every chunk held once, the early one first; causal work gives back the zig-zag;
and no pairing of the chunks has a busier rank (against every pairing, ties and equal works
included). The ring attending with these pairs: tests/test_document_mask.py."""

from __future__ import annotations

import random

import pytest

from distlib.parallel.context import balance, chunks


def _pairings(items: list[int]):
    """Every way to cut ``items`` into pairs."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for i, other in enumerate(rest):
        for tail in _pairings(rest[:i] + rest[i + 1 :]):
            yield [(first, other), *tail]


@pytest.mark.parametrize("cp", [0, 1, 2, 3, 4])
def test_no_pairing_has_a_busier_rank(cp):
    rng = random.Random(cp)
    for _ in range(40):
        work = [rng.randint(1, 3 if rng.random() < 0.5 else 2 * cp + 1) for _ in range(2 * cp)]
        owned = balance.balanced(work)
        assert len(owned) == cp
        assert sorted(c for pair in owned for c in pair) == list(range(2 * cp))
        assert all(a < b for a, b in owned)
        busiest = max((work[a] + work[b] for a, b in owned), default=0)
        best = min(max((work[a] + work[b] for a, b in p), default=0) for p in _pairings(list(range(2 * cp))))
        assert busiest == best, (work, owned)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8, 16])
def test_causal_work_gives_the_zigzag(cp):
    """Without documents chunk c reaches c + 1 chunks; a document starting at 0 is the same."""
    assert balance.balanced([c + 1 for c in range(2 * cp)]) == chunks.zigzag(cp)
    assert balance.chunk_work([0] * (2 * cp), 4) == [c + 1 for c in range(2 * cp)]


def test_an_odd_number_of_chunks_is_refused():
    with pytest.raises(ValueError, match="3 chunks do not pair up"):
        balance.balanced([1, 2, 3])


def test_without_documents_nothing_is_rebalanced():
    assert balance.owned(None, 4) is None
