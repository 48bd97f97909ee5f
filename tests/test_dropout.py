"""Dropout masks keyed by (seed, global sample, block, site) (distlib/parallel/dropout.py): a rank's
part of a mask is the whole mask at the rank's indices, however the heads, positions and samples
are split (empty parts included); a sample's mask does not depend on the batch it is in; every key
changes it; without keys dropout is torch's F.dropout. The layouts trained with these masks are in
tests/test_families_train.py, test_sequence_parallel.py, test_context_parallel.py and
test_expert_parallel_train.py."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from distlib.parallel.dropout import Draws, dropout

P = 0.25
FULL = (4, 12, 12)  # heads, query positions, key positions


def _whole(draws: Draws) -> torch.Tensor:
    like = torch.empty(0)
    return draws.noise("attn.weights", P, FULL, (None, None, None), like)


def _cuts(n: int, parts: int, rng: random.Random) -> list[list[int]]:
    """0..n-1 shuffled and cut into ``parts`` pieces, some of them empty."""
    order = list(range(n))
    rng.shuffle(order)
    bounds = sorted(rng.choice([0, n, rng.randrange(n + 1)]) for _ in range(parts - 1))
    return [order[a:b] for a, b in zip([0, *bounds], [*bounds, n])]


@pytest.mark.parametrize("trial", range(6))
def test_a_ranks_part_is_the_whole_mask_at_its_indices_for_any_split(trial):
    rng = random.Random(trial)
    draws = Draws(seed=7, samples=(3, 9), layer=1)
    whole = _whole(draws)
    for heads in _cuts(FULL[0], 3, rng):
        for rows in _cuts(FULL[1], 3, rng):
            index = (torch.tensor(heads, dtype=torch.long), torch.tensor(rows, dtype=torch.long), slice(0, 5))
            part = draws.noise("attn.weights", P, FULL, index, torch.empty(0))
            assert part.shape == (2, len(heads), len(rows), 5)
            assert torch.equal(part, whole[:, heads][:, :, rows][..., :5])


def test_a_samples_mask_does_not_depend_on_its_batch():
    pair = _whole(Draws(seed=7, samples=(3, 9)))
    alone = [_whole(Draws(seed=7, samples=(k,))) for k in (9, 3)]
    assert torch.equal(pair, torch.cat(alone[::-1]))
    assert _whole(Draws(seed=7, samples=())).shape == (0, *FULL)  # an empty batch: no rows


def test_every_key_changes_the_mask_and_the_same_keys_repeat_it():
    base = Draws(seed=7, samples=(3,), layer=1)
    same = _whole(Draws(seed=7, samples=(3,), layer=1))
    assert torch.equal(_whole(base), same)
    for other in (
        Draws(seed=8, samples=(3,), layer=1),
        Draws(seed=7, samples=(4,), layer=1),
        Draws(seed=7, samples=(3,), layer=2),
    ):
        assert not torch.equal(_whole(other), same), other
    like = torch.empty(0)
    assert not torch.equal(base.noise("attn.out", P, FULL, (None,) * 3, like), same)


def test_factors_are_zero_or_the_inverse_keep_rate_in_the_expected_share():
    noise = _whole(Draws(seed=1, samples=tuple(range(20))))
    values = set(noise.unique().tolist())
    assert values == {0.0, torch.tensor(1 / (1 - P)).item()}
    kept = float((noise > 0).float().mean())
    assert abs(kept - (1 - P)) < 0.01, kept


def test_head_ids_follow_the_tensor_and_ulysses_shares():
    draws = Draws(seed=0, samples=(0,), share=(1, 2))  # tensor-parallel rank 1 of 2
    assert draws.head_ids(3, "cpu").tolist() == [3, 4, 5]
    # Ulysses rank 2 of 3 inside it: its third of this rank's 6 heads
    assert draws.head_ids(2, "cpu", within=(2, 3)).tolist() == [10, 11]


def test_without_keys_it_is_torchs_dropout_and_off_it_is_the_input():
    x = torch.randn(2, 5, 8)
    torch.manual_seed(3)
    ours = dropout(x, P, True, None, "embed", (5, 8), (None, None))
    torch.manual_seed(3)
    assert torch.equal(ours, F.dropout(x, P, True))
    draws = Draws(seed=0, samples=(0, 1))
    assert dropout(x, P, False, draws, "embed", (5, 8), (None, None)) is x
    assert dropout(x, 0.0, True, draws, "embed", (5, 8), (None, None)) is x


def test_keyed_dropout_multiplies_by_the_factors_and_checks_the_batch():
    x = torch.randn(2, 5, 8)
    draws = Draws(seed=0, samples=(4, 6))
    got = dropout(x, P, True, draws, "embed", (5, 8), (None, None))
    assert torch.equal(got, x * draws.noise("embed", P, (5, 8), (None, None), x))
    with pytest.raises(ValueError, match="a batch of 2 rows keyed by 3 samples"):
        Draws(seed=0, samples=(1, 2, 3)).apply(x, P, "embed", (5, 8), (None, None))
