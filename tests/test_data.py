import numpy as np
import pytest

from distlib.data import BatchPlan, GlobalBatches, make_corpus


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
    per_rank = [GlobalBatches(tokens, 16, BatchPlan(plan_global, world, 1), seed=1).micro_batches(3, r)[0][0]
                for r in range(world)]
    single = GlobalBatches(tokens, 16, BatchPlan(plan_global, 1, 1), seed=1).micro_batches(3, 0)[0][0]
    stacked = np.concatenate([p.numpy() for p in per_rank])
    assert np.array_equal(stacked, single.numpy()), "ranks' slices must tile the world-size-1 global batch"
    rows = {row.tobytes() for row in stacked}
    assert len(rows) == plan_global


def test_targets_are_inputs_shifted_by_one():
    batches = GlobalBatches(make_corpus(0, 3000), 16, BatchPlan(4, 1, 1), seed=0)
    (x, y), = batches.micro_batches(0, 0)
    assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())


def test_global_batch_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="does not divide"):
        BatchPlan(10, 4, 1)
