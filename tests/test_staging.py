"""The staging buffers an async save copies into are reused from save to save, hold the values of
the latest copy (never stale ones), and are never written over while a background write may still
read them."""

from __future__ import annotations

import pytest
import torch

from distlib.checkpoint.staging import StagingBuffers


def _sources() -> dict[str, torch.Tensor]:
    return {"master": torch.randn(1000), "exp_avg": torch.randn(10, 7), "step": torch.arange(5)}


def test_stage_copies_into_reused_buffers_and_a_later_stage_holds_the_new_values():
    staging, sources = StagingBuffers(), _sources()
    first = staging.stage(sources)
    assert all(torch.equal(first[k], v) and first[k].data_ptr() != v.data_ptr() for k, v in sources.items())
    ptrs = {k: t.data_ptr() for k, t in first.items()}
    for v in sources.values():  # the training step changes the state in place
        v.add_(3)
    second = staging.stage(sources)
    assert {k: t.data_ptr() for k, t in second.items()} == ptrs  # the same memory ...
    assert all(torch.equal(second[k], v) for k, v in sources.items())  # ... with the new values
    # A view (stage 0 saves its slice of a full-size buffer) stages its own elements only.
    view = {"master": sources["master"][100:300]}
    assert torch.equal(staging.stage(view)["master"], sources["master"][100:300])


def test_a_changed_shape_or_dtype_gets_a_new_buffer():
    staging = StagingBuffers()
    a = staging.stage({"x": torch.ones(4)})["x"]
    b = staging.stage({"x": torch.ones(5)})["x"]
    c = staging.stage({"x": torch.ones(5, dtype=torch.float64)})["x"]
    assert b.shape == (5,) and c.dtype == torch.float64
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3


def test_buffers_lent_to_an_unfinished_write_are_never_written_over():
    staging, sources = StagingBuffers(), _sources()
    staged = staging.stage(sources)
    kept = {k: v.clone() for k, v in staged.items()}
    finished = []
    staging.lend(lambda: bool(finished))
    sources["master"].add_(1)
    with pytest.raises(RuntimeError, match="at most one save in flight"):
        staging.stage(sources)
    assert all(torch.equal(staged[k], kept[k]) for k in kept)  # untouched
    finished.append(True)
    assert torch.equal(staging.stage(sources)["master"], sources["master"])


def test_handed_over_tensors_are_never_written_again_and_taken_back_ones_are_reused():
    staging, sources = StagingBuffers(), _sources()
    snapshot = staging.stage(sources)
    kept = {k: v.clone() for k, v in snapshot.items()}
    staging.hand_over()  # e.g. verify_resume's snapshot keeps them
    sources["master"].add_(1)
    fresh = staging.stage(sources)
    assert fresh["master"].data_ptr() != snapshot["master"].data_ptr()
    assert all(torch.equal(snapshot[k], kept[k]) for k in kept)
    staging.hand_over()
    staging.take_back({**snapshot, "unknown": torch.ones(3)})  # the old snapshot is read no more
    again = staging.stage(sources)
    assert {k: t.data_ptr() for k, t in again.items()} == {k: t.data_ptr() for k, t in snapshot.items()}
    assert torch.equal(again["master"], sources["master"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_from_cuda_the_buffers_are_pinned_and_the_writer_sees_the_copy_of_that_moment():
    staging = StagingBuffers()
    source = torch.randn(1 << 22, device="cuda")
    expected = source.cpu()
    staged = staging.stage({"master": source})["master"]
    source.add_(1)  # the next step, queued behind the copy on the same stream
    staging.wait_copied()  # what the background writer does before it reads
    assert staged.is_pinned() and torch.equal(staged, expected)
    again = staging.stage({"master": source})["master"]
    staging.wait_copied()
    assert again.data_ptr() == staged.data_ptr() and torch.equal(again, source.cpu())
