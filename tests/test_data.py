import numpy as np
import pytest

from distlib.app.data.batches import BatchPlan, GlobalBatches, make_corpus


def test_corpus_is_deterministic_and_learnable():
    a, b = make_corpus(5, 5000), make_corpus(5, 5000)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, make_corpus(6, 5000))
    # each token's most frequent successor dominates: the structure the model learns
    pairs = np.zeros((64, 64))
    np.add.at(pairs, (a[:-1], a[1:]), 1)
    assert (pairs.max(axis=1) / pairs.sum(axis=1)).mean() > 0.8


def test_ranks_get_disjoint_slices_of_one_global_batch():
    tokens = make_corpus(0, 20000)
    world, plan_global = 4, 16
    per_rank = [
        GlobalBatches(tokens, 16, BatchPlan(plan_global, world, 1), seed=1).micro_batches(3, r)[0][0]
        for r in range(world)
    ]
    single = GlobalBatches(tokens, 16, BatchPlan(plan_global, 1, 1), seed=1).micro_batches(3, 0)[0][0]
    stacked = np.concatenate([p.numpy() for p in per_rank])
    assert np.array_equal(stacked, single.numpy()), "ranks' slices must tile the world-size-1 global batch"
    rows = {row.tobytes() for row in stacked}
    assert len(rows) == plan_global


def test_targets_are_inputs_shifted_by_one():
    batches = GlobalBatches(make_corpus(0, 3000), 16, BatchPlan(4, 1, 1), seed=0)
    ((x, y),) = batches.micro_batches(0, 0)
    assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())


def test_global_batch_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="does not divide"):
        BatchPlan(10, 4, 1)


def _make_corpus_loop(seed, total_tokens, vocab_size=64, follow_prob=0.9):
    """The original, one-token-at-a-time definition of the corpus (the reference)."""
    rng = np.random.default_rng(seed)
    successor = rng.permutation(vocab_size)
    follow = rng.random(total_tokens) < follow_prob
    noise = rng.integers(0, vocab_size, size=total_tokens)
    tokens = np.empty(total_tokens, dtype=np.int64)
    tokens[0] = noise[0]
    for i in range(1, total_tokens):
        tokens[i] = successor[tokens[i - 1]] if follow[i] else noise[i]
    return tokens


@pytest.mark.parametrize(
    "seed,total,vocab,follow",
    [
        (0, 65536, 64, 0.9),  # the capstone's corpus
        (1, 5000, 64, 0.9),
        (7, 3001, 33, 0.9),
        (123, 4096, 256, 0.9),
        (5, 2000, 2, 0.5),
        (9, 2000, 64, 0.0),
        (11, 3000, 17, 1.0),
        (13, 2, 64, 0.9),
        (17, 10000, 1000, 0.97),
    ],
)
def test_vectorised_corpus_equals_the_token_by_token_loop(seed, total, vocab, follow):
    fast = make_corpus(seed, total, vocab, follow)
    slow = _make_corpus_loop(seed, total, vocab, follow)
    assert fast.dtype == slow.dtype == np.int64
    assert fast.tobytes() == slow.tobytes()
