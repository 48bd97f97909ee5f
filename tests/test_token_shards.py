"""The token cache in shards (distlib/app/data/token_shards.py, issue 39 item 3), through the
pretrained-tokenizer path that uses it (``pretrained.ensure``, collective over the ranks).

Every rank encodes its block of the documents; the cache's bytes (every shard and index.json) are
the same at world sizes 1, 2 and 4, with shards small enough that the ranks' pieces cross shard
edges, and with more ranks than documents (empty blocks); the stream is the tokenizer's own ids,
document after document. A second run reuses it, a changed file rebuilds it, and a build that fails
on any rank (a bad line it alone reads, a build directory it cannot see) is every rank's one error
and leaves no directory behind and the old cache as it was. The reading view equals the
concatenated shards for every slice, empty ones included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from multiproc import run_ranks

from distlib.app.config.data_group import DataConfig
from distlib.app.data import pretrained, token_shards
from distlib.app.data.tokens import DataError

tokenizers = pytest.importorskip("tokenizers", reason="needs the `hf` extra (tokenizers)")

WORDS = "the a cat dog sat ran on under mat log big small red blue and then it was".split()
SHARD = 37  # tokens per shard: small, so that ranks' pieces and held-out starts cross shard edges


def _corpus(root: Path, n: int, seed: int = 0) -> tuple[Path, list[str]]:
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) for _ in range(n)]
    path = root / f"corpus{n}.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs


def _tokenizer(root: Path) -> Path:
    """A word-level tokenizer with </s> as its end-of-text token, saved as a directory."""
    vocab = {w: i for i, w in enumerate(["</s>", "<unk>", *WORDS])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    out = root / "tok"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return out


def _config(corpus: Path, tok: Path, cache: Path) -> DataConfig:
    return DataConfig(
        kind="text", path=str(corpus), tokenizer=str(tok), cache_dir=str(cache), val_fraction=0.2
    )


def _build(comm, d: DataConfig) -> dict:
    token_shards.SHARD_TOKENS = SHARD  # (this forked rank's module)
    token_shards.PROGRESS_EVERY_S = 0.0  # rank 0 says where it is after every document
    said = []
    cache, built = pretrained.ensure(d, pretrained.PretrainedTokenizer(d.tokenizer), 64, comm, said.append)
    files = {p.name: p.read_bytes() for p in sorted(cache.path.iterdir())}
    return {"built": built, "files": files, "said": said, "val_start": cache.val_start}


def _expected(tok: Path, docs: list[str]) -> list[int]:
    t = pretrained.PretrainedTokenizer(tok)
    return [i for d in docs for i in t.encode_document(d)]


@pytest.mark.parametrize("n_docs", [23, 3])
def test_the_cache_is_the_same_bytes_at_every_world_size(tmp_path, n_docs):
    corpus, docs = _corpus(tmp_path, n_docs)
    tok = _tokenizer(tmp_path)
    got = {}
    for world in (1, 2, 4):
        d = _config(corpus, tok, tmp_path / f"cache{world}")
        ranks = run_ranks(_build, world, d)
        assert all(r["built"] for r in ranks) and all(r["files"] == ranks[0]["files"] for r in ranks)
        got[world] = ranks[0]
    assert got[1]["files"] == got[2]["files"] == got[4]["files"]
    files = got[1]["files"]
    index = json.loads(files["index.json"])
    stream = np.concatenate([np.frombuffer(files[s["file"]], dtype="<u2") for s in index["shards"]])
    assert stream.tolist() == _expected(tok, docs)
    assert [s["tokens"] for s in index["shards"]][:-1] == [SHARD] * (len(index["shards"]) - 1)
    held = index["key"]["held_documents"]
    assert held > 0 and index["val_start"] == len(_expected(tok, docs[: n_docs - held]))
    if n_docs == 23:
        assert len(index["shards"]) > 4  # several shards, each rank's block spanning edges
        assert got[2]["said"] and got[2]["said"][0].startswith("tokenizing: rank 0 at document 1 of its 11")
    # (3 documents over 4 ranks: rank 0's block is empty, and the bytes are the same)


def test_reused_until_a_file_changes_and_a_failed_build_leaves_the_old_cache(tmp_path):
    corpus, _ = _corpus(tmp_path, 12)
    tok = _tokenizer(tmp_path)
    d = _config(corpus, tok, tmp_path / "cache")
    first = run_ranks(_build, 2, d)[0]
    assert first["built"]
    again = run_ranks(_build, 2, d)[0]
    assert not again["built"] and again["files"] == first["files"]
    with open(corpus, "a") as f:  # a changed source: rebuilt, but the build fails on rank 1
        f.write(json.dumps({"text": "the end"}) + "\n")
    errors = run_ranks(_build_or_error, 2, d, 1)
    assert errors[0] == errors[1] and "line 2 is not JSON" in errors[0], errors
    (cache,) = (tmp_path / "cache").iterdir()  # no temporary directory left, the old cache whole
    assert {p.name: p.read_bytes() for p in sorted(cache.iterdir())} == first["files"]
    rebuilt = run_ranks(_build, 2, d)[0]
    assert rebuilt["built"] and rebuilt["files"] != first["files"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [cache.name]


def test_a_failure_on_one_rank_is_every_ranks_error_and_leaves_nothing(tmp_path):
    corpus, _ = _corpus(tmp_path, 6)
    d = _config(corpus, _tokenizer(tmp_path), tmp_path / "cache")
    for failing in (0, 1):
        errors = run_ranks(_build_or_error, 2, d, failing)
        assert errors[0] == errors[1] and "line 2 is not JSON" in errors[0], errors
        assert not any((tmp_path / "cache").iterdir())


def _build_or_error(comm, d: DataConfig, failing: int) -> str:
    """Rank ``failing`` alone reads the corpus's line 2 as a bad one (a node with a damaged copy),
    after rank 0 has counted the documents: the build itself fails there."""
    from distlib.app.data import documents

    if comm.rank == failing:
        good = documents._lines

        def damaged(path, sha):  # line 2 of the last file (every rank reads it, if only to skip it)
            lines = list(good(path, sha))
            yield from [*lines[:1], "{not json\n", *lines[2:]]

        calls = iter([False] + [True] * 10) if comm.rank == 0 else iter([True] * 10)  # rank 0 surveys first
        documents._lines = lambda path, sha: damaged(path, sha) if next(calls) else good(path, sha)
    try:
        _build(comm, d)
        return "built"
    except DataError as exc:
        return str(exc)


@pytest.mark.parametrize("sizes", [[5, 0, 7, 1], [1], [0, 3], [4, 4, 4]])
def test_slices_of_the_shards_are_slices_of_the_stream(sizes):
    rng = np.random.default_rng(len(sizes))
    maps = [rng.integers(0, 1000, size=n).astype("<u2") for n in sizes]
    whole = np.concatenate(maps)
    view = token_shards.ShardedTokens(maps)
    assert len(view) == len(whole)
    for lo in range(len(whole) + 1):
        for hi in range(lo, len(whole) + 2):
            assert np.asarray(view[lo:hi]).tolist() == whole[lo:hi].tolist()
            inner = view[lo:hi][1:]  # a slice of a slice
            assert np.asarray(inner, dtype=np.int64).tolist() == whole[lo:hi][1:].tolist()
    assert token_shards.block(3, 4, 0) == (0, 0) and token_shards.block(0, 2, 1) == (0, 0)


def _build_unseen(comm, d: DataConfig) -> str:
    """Rank 1 is handed a build directory it cannot see (a node without the shared filesystem)."""
    if comm.rank == 1:
        made = token_shards.Plan

        def elsewhere(target, tmp, *rest):
            return made(target, tmp.with_name(tmp.name + "-on-another-node"), *rest)

        pretrained.token_shards.Plan = elsewhere
    try:
        _build(comm, d)
        return "built"
    except DataError as exc:
        return str(exc)


def test_a_rank_that_cannot_see_the_build_directory_says_so(tmp_path):
    corpus, _ = _corpus(tmp_path, 6)
    d = _config(corpus, _tokenizer(tmp_path), tmp_path / "cache")
    errors = run_ranks(_build_unseen, 2, d)
    assert errors[0] == errors[1] and "rank 1 cannot see" in errors[0] and "shared filesystem" in errors[0]
    assert not any((tmp_path / "cache").iterdir())


def _open_unseen(comm, d: DataConfig) -> str:
    """Rank 1 sees no cache where rank 0 built one (a node without the shared filesystem)."""
    if comm.rank == 1:
        token_shards.open_cache = lambda path, key: None
    try:
        _build(comm, d)
        return "opened"
    except DataError as exc:
        return str(exc)


def test_a_rank_that_cannot_see_the_built_cache_says_so_on_every_rank(tmp_path):
    corpus, _ = _corpus(tmp_path, 6)
    errors = run_ranks(_open_unseen, 2, _config(corpus, _tokenizer(tmp_path), tmp_path / "cache"))
    assert errors[0] == errors[1] and "is missing or stale on this node after rank 0" in errors[0]
