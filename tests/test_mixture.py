"""data.mixture (distlib/app/data/mixture.py): several sources, each global sample drawn from one by
the weights, from the seed and the sample's number alone. Checked against a plain sequential
drawing (blocks small, so the draws cross many of them; a source nearly never drawn, so blocks
without it), for its shares, its windows, its independence of the world size; through the trainer,
2 ranks against 1 and a resume at another world size at the exact data position, the step records'
counts per source, and what a changed mixture or bad configuration says."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from multiproc import run_ranks
from trainrun import compose_tree, train_each

from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.data import bpe, bpe_tokens, mixture, text_source
from distlib.app.data.batches import BatchPlan
from distlib.app.data.mixture import MixedBatches, MixedHeldOut, Mixture, SourceWindows
from distlib.app.data.tokens import DataError
from distlib.comm.group import Comm

ROOT = Path(__file__).resolve().parent.parent
SHARES = (0.6, 0.3, 0.0999, 0.0001)  # the last: most blocks of 64 never draw it


def _sequential(shares: tuple[float, ...], seed: int, n: int) -> list[tuple[int, int]]:
    """(source, number within it) of samples 0..n-1, drawn one after another (the definition)."""
    out, taken = [], [0] * len(shares)
    edges = np.cumsum(shares)[:-1]
    for k in range(n):
        b, i = divmod(k, mixture.BLOCK)
        u = np.random.default_rng([seed, mixture.MIXTURE, b]).random(mixture.BLOCK)[i]
        s = int(np.searchsorted(edges, u, side="right"))
        out.append((s, taken[s]))
        taken[s] += 1
    return out


def test_each_sample_is_the_sequential_drawings_in_any_order(monkeypatch):
    monkeypatch.setattr(mixture, "BLOCK", 64)
    expected = _sequential(SHARES, 3, 64 * 40)
    mix = Mixture(SHARES, 3)
    order = list(range(len(expected)))
    random.Random(0).shuffle(order)  # blocks visited out of order, as a resume and the ranks do
    assert {k: mix.locate(k) for k in order} == dict(enumerate(expected))
    for first, stop in [(0, 0), (0, 1), (5, 64), (60, 200), (0, 64 * 40), (1000, 1000)]:
        drawn = [s for s, _ in expected[first:stop]]
        assert mix.counts(first, stop) == [drawn.count(s) for s in range(len(SHARES))]
    assert Mixture((1.0,), 3).locate(12345) == (0, 12345)  # one source: every sample, in order


def test_the_shares_drawn_follow_the_weights():
    counts = Mixture((0.5, 0.3, 0.2), 0).counts(0, 200_000)
    assert sum(counts) == 200_000
    assert np.allclose(np.array(counts) / 200_000, (0.5, 0.3, 0.2), atol=0.005), counts


def test_a_sources_samples_run_through_each_epoch_once():
    tokens = np.arange(1 + 10 * 4)  # 10 windows of 4
    src = SourceWindows(tokens, 4, seed=1, source=2)
    firsts = [int(src.sample(j)[0]) for j in range(30)]
    for epoch in range(3):
        assert sorted(firsts[10 * epoch : 10 * epoch + 10]) == list(range(0, 40, 4))
    assert firsts[:10] != firsts[10:20]  # another order each epoch
    assert src.sample(3).tolist() == list(range(firsts[3], firsts[3] + 5))


def test_the_ranks_read_the_global_batch_whatever_the_world_size():
    sources = [np.arange(1000) % 50, 100 + np.arange(300) % 50]
    batches = {
        world: MixedBatches(
            [SourceWindows(t, 8, 5, s) for s, t in enumerate(sources)],
            (0.7, 0.3),
            BatchPlan(8, world, 2 if world == 2 else 1),
            5,
            {"kind": "mixture"},
        )
        for world in (1, 2, 4)
    }
    for step in (0, 7, 300):  # step 300 runs the second source through more than one epoch
        whole = torch.cat([x for x, _ in batches[1].micro_batches(step, 0)])
        for world in (2, 4):
            parts = [x for r in range(world) for x, _ in batches[world].micro_batches(step, r)]
            assert torch.equal(torch.cat(parts), whole), (world, step)
        from_second = int((whole[:, 0] >= 100).sum())
        assert batches[1].step_fields(step + 1) == {"mixture": [8 - from_second, from_second]}


def test_the_held_out_windows_are_each_sources_first_by_its_weight():
    helds = [np.arange(100), 1000 + np.arange(100), 2000 + np.arange(3)]  # the last: no window at all
    held = MixedHeldOut(helds, 9, 10, (0.7, 0.3, 0.0))
    firsts = [int(held.window(w)[0]) for w in range(held.num_windows)]
    assert firsts == [0, 9, 18, 27, 36, 45, 54, 1000, 1009, 1018]  # 7 and 3 of 10; (max(1, 0): none there)
    assert held.window(8).tolist() == list(range(1009, 1019))
    everything = torch.cat([x for x, _ in held.batches(0, 1, 4)])
    shared = torch.cat([x for r in range(3) for x, _ in held.batches(r, 3, 4)])
    assert torch.equal(everything, shared) and everything[:, 0].tolist() == firsts
    for world in (1, 3, 11):  # (11 ranks: some hold no window)
        for rank in range(world):
            for source, x, _ in held.sourced_batches(rank, world, 4):  # a batch holds one source's
                assert {int(t) // 1000 for t in x[:, 0]} == {source}


# -- configuration ---------------------------------------------------------------------
MIX = ["data=mixture", "data.mixture=[a.txt,b.txt]"]


@pytest.mark.parametrize(
    "overrides, line",
    [
        ([*MIX, "data.weights=[1]"], "data.weights has 1 weight(s) for the 2 source(s) of data.mixture"),
        ([*MIX, "data.weights=[0,1]"], "data.weights must be null or a list of numbers each > 0, got [0, 1]"),
        (["data=text", "data.mixture=[a.txt]"], "data.mixture lists the sources in place of data.path="),
        (["data=mixture", "data.mixture=[]"], "data.mixture must list at least one source"),
        (["data.weights=[1,2]"], "data.weights=(1.0, 2.0) has no effect with data.kind=synthetic"),
    ],
)
def test_a_bad_mixture_is_one_line_naming_the_key(overrides, line):
    with pytest.raises(ConfigError, match=re.escape(line)):
        RunConfig.from_dict(compose_tree(overrides))


def test_a_missing_source_is_named_before_any_worker_starts(tmp_path):
    from distlib.app.data import corpus

    (tmp_path / "a.txt").write_text("some text " * 100)
    listed = f"data.mixture=[{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}]"
    cfg = RunConfig.from_dict(compose_tree(["data=mixture", listed]))
    with pytest.raises(DataError, match=f"data.path {tmp_path / 'b.txt'} does not exist"):
        corpus.check_source(cfg)


def test_sources_of_one_name_keep_a_cache_each_in_the_cache_dir(tmp_path):
    """Two sources named alike, one data.cache_dir: each keeps its own token file (source-<i>/
    there), so neither build replaces the other's and a second start reuses both."""
    from distlib.app.data import corpus

    for part in ("web", "code"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "train.txt").write_text(f"{part} text, " * 400)
    listed = f"data.mixture=[{tmp_path / 'web' / 'train.txt'},{tmp_path / 'code' / 'train.txt'}]"
    cfg = RunConfig.from_dict(
        compose_tree(["data=mixture", listed, f"data.cache_dir={tmp_path / 'c'}", *SMALL])
    )
    one = Comm(ranks=(0,), rank=0)
    first, _ = corpus.build(cfg, one, BatchPlan(16, 1, 1))
    files = [tmp_path / "c" / f"source-{i}" / "train.txt.u8.tokens" for i in (0, 1)]
    stamps = [f.stat().st_mtime_ns for f in files]
    again, _ = corpus.build(cfg, one, BatchPlan(16, 1, 1))
    assert [f.stat().st_mtime_ns for f in files] == stamps  # reused, not rebuilt
    words = [bytes(np.asarray(s.tokens[:4], dtype=np.uint8)) for s in again.sources]
    assert words == [b"web ", b"code"] and again.source == first.source


# -- through the trainer -------------------------------------------------------------------
def _texts(root: Path) -> list[Path]:
    """Two texts unlike each other: the bundled sample, and digits."""
    shutil.copy(ROOT / "data" / "sample.txt", root / "prose.txt")
    digits = "".join(random.Random(0).choice("0123456789 ") for _ in range(20_000))
    (root / "digits.txt").write_text(digits)
    return [root / "prose.txt", root / "digits.txt"]


SMALL = ["model.seq_len=32", "model.dim=32"]


def _common(paths: list[Path]) -> list[str]:
    listed = ",".join(str(p) for p in paths)
    return [
        "data=mixture",
        f"data.mixture=[{listed}]",
        "data.weights=[3,1]",
        "model.seq_len=32",
        "model.dim=32",
    ]


def _run(world: int, overrides: list[str], run_dir: Path) -> dict:
    tree = compose_tree([*overrides, f"dist.world_size={world}", "metrics.progress_every=0"])
    return run_ranks(train_each, world, [tree], str(run_dir))[0][0]


def test_a_mixture_trains_alike_at_every_world_size_and_resumes_elsewhere_exactly(tmp_path):
    held_out = ["data.val_fraction=0.1", "train.eval_every=3"]  # each source's tail
    common = _common(_texts(tmp_path)) + ["train.steps=6", "checkpoint.verify_resume=false", *held_out]
    one = _run(1, [*common, "checkpoint.every_steps=0"], tmp_path / "one")
    two = _run(2, [*common, "checkpoint.every_steps=3"], tmp_path / "two")
    counts = [r["mixture"] for r in one["records"]]
    assert [r["mixture"] for r in two["records"]] == counts
    assert all(sum(c) == 16 for c in counts) and 0 < sum(c[1] for c in counts) < sum(c[0] for c in counts)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(two["losses"], one["losses"]))
    saved = tmp_path / "two" / "0" / "checkpoints" / "step_00000003"
    moved = tmp_path / "moved"  # the sources are known by their content, not where they are
    moved.mkdir()
    common = _common(_texts(moved)) + ["train.steps=6", "checkpoint.verify_resume=false", *held_out]
    again = _run(1, [*common, "checkpoint.every_steps=0", f"checkpoint.resume={saved}"], tmp_path / "again")
    assert [r["step"] for r in again["records"]] == [4, 5, 6]
    assert [r["mixture"] for r in again["records"]] == counts[3:]
    # at the exact data position: a batch off would differ by far more than 1e-5
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(again["losses"], one["losses"][3:]))
    vals = [[r["val_loss"] for r in run["records"] if "val_loss" in r] for run in (one, two, again)]
    assert len(vals[0]) == 2 and vals[0][1] < vals[0][0]
    assert vals[1] == pytest.approx(vals[0], rel=1e-6) and vals[2] == pytest.approx(vals[0][1:], rel=1e-6)
    each = [[r["val_loss_by_source"] for r in run["records"] if "val_loss" in r] for run in (one, two)]
    assert each[1] == [pytest.approx(v, rel=1e-6) for v in each[0]]
    assert all(min(v) < total < max(v) for v, total in zip(each[0], vals[0]))  # their token mean
    assert not any("val_loss_by_source" in r for r in one["records"] if "val_loss" not in r)
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["data"]["source"]["kind"] == "mixture" and len(manifest["data"]["source"]["sources"]) == 2


def test_resume_refuses_other_weights_and_a_changed_source_naming_them(tmp_path):
    paths = _texts(tmp_path)
    common = _common(paths) + ["train.steps=2", "checkpoint.verify_resume=false"]
    _run(1, [*common, "checkpoint.every_steps=2"], tmp_path / "a")
    saved = tmp_path / "a" / "0" / "checkpoints" / "step_00000002"
    resume = [f"checkpoint.resume={saved}", "train.steps=3", "checkpoint.every_steps=0"]
    reweighed = [o if not o.startswith("data.weights") else "data.weights=[1,1]" for o in common]
    with pytest.raises(AssertionError, match=r"data.weights: checkpoint \[3.0, 1.0\], this run \[1.0, 1.0\]"):
        _run(1, [*reweighed, *resume], tmp_path / "b")
    paths[1].write_text(paths[1].read_text() + "9")
    with pytest.raises(AssertionError, match="data.mixture source 1: the text file's content changed"):
        _run(1, [*common, *resume], tmp_path / "c")


# -- one BPE for every source --------------------------------------------------------------
BPE = ["data.tokenizer=bpe", "data.vocab_size=300"]


def test_a_bpe_mixture_trains_one_tokenizer_on_every_sources_training_text(tmp_path):
    """data.tokenizer=bpe with data.mixture: one tokenizer learned from both training texts (the
    held-out tails never reach it), each source encoded with it into its own token file, reused
    while nothing changed; a source of the same name elsewhere keeps its own file, and a source's
    own cache (bpe on it alone: another tokenizer) is left as it was."""
    paths = _texts(tmp_path)
    twin = tmp_path / "elsewhere"
    twin.mkdir()
    (twin / "prose.txt").write_text("other prose, other words. " * 300)
    paths.append(twin / "prose.txt")
    cache = str(tmp_path / "cache")
    alone = bpe_tokens.ensure(paths[0], cache, 300, 0.1)
    built, tok_path, fresh = bpe_tokens.ensure_many(paths, cache, 300, 0.1)
    assert fresh and len({c.path for c in built}) == 3
    assert tok_path.name.startswith("mix-") and tok_path != alone[1]
    parts = []
    for p in paths:
        source = text_source.scan(p)
        parts.append(
            text_source.split_text(text_source.read_text(source), text_source.split_byte(source, 0.1))
        )
    want = bpe.train_tokenizer([train for train, _ in parts], 300)
    assert bpe.tokenizer_sha256(tok_path) == want.sha256 != alone[0].index["key"]["tokenizer_sha256"]
    for c, (train, held) in zip(built, parts):
        assert c.tokens().tolist() == want.encode(train) + want.encode(held)
        assert c.val_start == len(want.encode(train)) and c.index["key"]["tokenizer_sha256"] == want.sha256
    again, _, rebuilt = bpe_tokens.ensure_many(paths, cache, 300, 0.1)
    assert not rebuilt and [c.path for c in again] == [c.path for c in built]
    assert bpe_tokens.ensure(paths[0], cache, 300, 0.1) == (*alone[:2], False)  # its own cache untouched
    paths[1].write_text(paths[1].read_text() + "7")
    assert bpe_tokens.ensure_many(paths, cache, 300, 0.1)[2]


def test_a_bpe_mixture_trains_alike_at_two_ranks_and_resumes_at_one(tmp_path):
    """2 ranks against 1 within 1e-5, the run's tokenizer saved, the checkpoint naming it for each
    source; resumed by 1 rank at the exact data position, and refused once a source changed."""
    paths = _texts(tmp_path)
    common = _common(paths) + [*BPE, "train.steps=4", "checkpoint.verify_resume=false"]
    one = _run(1, [*common, "checkpoint.every_steps=0"], tmp_path / "one")
    two = _run(2, [*common, "checkpoint.every_steps=2"], tmp_path / "two")
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(two["losses"], one["losses"]))
    saved = tmp_path / "two" / "0" / "checkpoints" / "step_00000002"
    sources = json.loads((saved / "manifest.json").read_text())["data"]["source"]["sources"]
    own = bpe.tokenizer_sha256(saved / "tokenizer")
    assert [(s["tokenizer"], s["tokenizer_sha256"]) for s in sources] == [("bpe", own)] * 2
    resume = [f"checkpoint.resume={saved}", "checkpoint.every_steps=0"]
    again = _run(1, [*common, *resume], tmp_path / "again")
    assert [r["step"] for r in again["records"]] == [3, 4]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(again["losses"], one["losses"][2:]))
    paths[1].write_text(paths[1].read_text() + "9")
    with pytest.raises(AssertionError, match="data.mixture source 1: the text file's content changed"):
        _run(1, [*common, *resume], tmp_path / "changed")
