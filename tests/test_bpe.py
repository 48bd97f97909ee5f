"""data.tokenizer=bpe: a deterministic byte-level BPE trained on the training split, its token
cache, directory sources, the saved tokenizer/ directory, and a 2-rank run that resumes bitwise."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from multiproc import run_ranks
from trainrun import compose_tree

import train
from distlib.app.checkpointing import fit_check
from distlib.app.config.data_group import DataConfig
from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.data import bpe, bpe_tokens, corpus, text_source
from distlib.app.data.batches import BatchPlan
from distlib.app.data.tokens import DataError

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data" / "sample.txt"
VOCAB = 300  # small: 43 merges, quick to train on the 120 kB sample


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def sample(tmp_path) -> Path:
    """A private copy of the bundled sample, so caches land in tmp_path, not the repo."""
    path = tmp_path / "sample.txt"
    shutil.copy(SAMPLE, path)
    return path


# -- determinism -------------------------------------------------------------------------------
_BUILD = """
import sys
sys.path.insert(0, sys.argv[1])
from distlib.app.data import bpe_tokens
cache, tok, built = bpe_tokens.ensure(sys.argv[2], sys.argv[3], 512, 0.1)
assert built
print(cache.path, tok)
"""


def _build_in_fresh_processes(source: Path, caches: list[Path], envs: list[dict]) -> list[tuple[str, str]]:
    """(tokenizer.json sha256, index.json sha256) of a cache built in each of several fresh
    interpreters, started together (each pays Python's and torch's start-up); the index holds
    every shard's sha256."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD, str(ROOT), str(source), str(cache)],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cache, env in zip(caches, envs)
    ]
    shas = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        target, tok = out.splitlines()[-1].split()  # after the line saying it trained
        shas.append((_sha(Path(tok)), _sha(Path(target) / "index.json")))
    return shas


def test_training_is_deterministic_in_fresh_processes(tmp_path):
    # Each process seeds Rust's HashMaps afresh. Their environments' thread settings differ too, and
    # must not matter: bpe.serial keeps the work on the calling thread whatever they say.
    one, two = _build_in_fresh_processes(
        SAMPLE,
        [tmp_path / "a", tmp_path / "b"],
        [
            {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
            {"RAYON_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "true"},
        ],
    )
    assert one == two, "tokenizer.json or the token cache differs between two fresh processes"


def test_the_heldout_tail_does_not_influence_the_tokenizer(tmp_path):
    text = SAMPLE.read_text(encoding="utf-8")
    cut = text_source.split_byte(text_source.scan(SAMPLE), 0.1)
    train_text, val_text = text_source.split_text(text, cut)
    # Same length, same split byte; a tail whose pairs would dominate any tokenizer that saw it.
    odd_tail = ("zqxjk " * len(val_text.encode()))[: len(val_text.encode())]
    other = tmp_path / "other" / "sample.txt"
    other.parent.mkdir()
    other.write_text(train_text + odd_tail, encoding="utf-8")
    a = bpe_tokens.ensure(SAMPLE, str(tmp_path / "a"), VOCAB, 0.1)
    b = bpe_tokens.ensure(other, str(tmp_path / "b"), VOCAB, 0.1)
    ka, kb = a[0].index["key"], b[0].index["key"]
    assert ka["source_sha256"] != kb["source_sha256"] and ka["split_byte"] == kb["split_byte"] == cut
    assert _sha(a[1]) == _sha(b[1]) == ka["tokenizer_sha256"], "the held-out text changed the tokenizer"
    ta, tb = np.asarray(a[0].tokens()), np.asarray(b[0].tokens())
    assert a[0].val_start == b[0].val_start
    assert np.array_equal(ta[: a[0].val_start], tb[: b[0].val_start]) and not np.array_equal(ta, tb)


# -- the token cache -------------------------------------------------------------------------
def test_train_and_heldout_parts_encode_their_own_text(sample):
    cache, tok_path, _ = bpe_tokens.ensure(sample, None, VOCAB, 0.1)
    tok = bpe.load_tokenizer(tok_path)
    assert tok_path == sample.parent / "sample.txt.bpe300.tokenizer.json"
    assert cache.path == sample.parent / f"sample.txt.bpe300-{tok.sha256[:16]}.shards"
    text, cut = sample.read_text(encoding="utf-8"), cache.index["key"]["split_byte"]
    train_text, val_text = text_source.split_text(text, cut)
    mapped = cache.tokens()
    assert mapped.dtype == np.dtype("<u2") and cache.index["key"]["tokenizer_sha256"] == tok.sha256
    assert mapped[: cache.val_start].tolist() == tok.encode(train_text)
    assert mapped[cache.val_start :].tolist() == tok.encode(val_text)
    assert cut == len(text.encode()) - int(len(text.encode()) * 0.1)  # an ASCII cut


@pytest.mark.parametrize("chunk, val_fraction", [(2000, 0.1), (2000, 0.0), (10**9, 0.1)])
def test_every_rank_encodes_a_share_and_the_cache_is_the_same_bytes_at_every_world_size(
    tmp_path, monkeypatch, chunk, val_fraction
):
    """The text's safe pieces are the documents the ranks share (60-odd of 2,000 characters; or
    two, so at 4 ranks two encode nothing; or no held-out piece at all): the shards are the same
    bytes at world size 1, 2 and 4, and their ids the whole texts' encodings."""
    monkeypatch.setattr(bpe, "CHUNK_CHARS", chunk)  # the forked ranks inherit it
    indexes = {}
    for world in (1, 2, 4):
        cache_dir = str(tmp_path / f"ws{world}")
        caches = run_ranks(_ensure_cache, world, (SAMPLE, cache_dir, val_fraction))
        assert len({json.dumps(c, sort_keys=True) for c in caches}) == 1
        indexes[world] = caches[0]
        index_sha = _sha(Path(caches[0]["path"]) / "index.json")
        shards = [_sha(Path(caches[0]["path"]) / s["file"]) for s in caches[0]["index"]["shards"]]
        assert shards == [s["sha256"] for s in caches[0]["index"]["shards"]]
        indexes[world]["bytes"] = (index_sha, shards)
    assert indexes[1]["bytes"] == indexes[2]["bytes"] == indexes[4]["bytes"]
    cache, tok_path, built = bpe_tokens.ensure(SAMPLE, str(tmp_path / "ws4"), VOCAB, val_fraction)
    assert not built
    tok, key = bpe.load_tokenizer(tok_path), cache.index["key"]
    train_text, val_text = text_source.split_text(SAMPLE.read_text(encoding="utf-8"), key["split_byte"])
    assert cache.tokens().tolist() == tok.encode(train_text) + tok.encode(val_text)
    assert cache.val_start == len(tok.encode(train_text))


def _ensure_cache(comm, args) -> dict:
    source, cache_dir, val_fraction = args
    cache, _, built = bpe_tokens.ensure(source, cache_dir, VOCAB, val_fraction, comm)
    assert built
    return {"path": str(cache.path), "index": cache.index}


def test_cache_is_reused_unchanged_and_rebuilt_when_text_tokenizer_or_vocab_change(sample):
    cache, tok_path, built = bpe_tokens.ensure(sample, None, VOCAB, 0.1)
    assert built
    files = (cache.path / "index.json", tok_path)
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in files]
    again = bpe_tokens.ensure(sample, None, VOCAB, 0.1)
    assert again == (cache, tok_path, False)
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in files] == before, "rewritten"

    bigger = bpe_tokens.ensure(sample, None, VOCAB + 20, 0.1)
    assert bigger[2] and bigger[0].index["key"]["vocab_size"] == VOCAB + 20
    assert bpe.load_tokenizer(bigger[1]).vocab_size == VOCAB + 20

    tok_path.write_text(tok_path.read_text() + " ")  # the cached tokenizer changed: trained again
    assert (
        bpe_tokens.ensure(sample, None, VOCAB, 0.1)[2]
        and _sha(tok_path) == cache.index["key"]["tokenizer_sha256"]
    )
    assert bpe_tokens.ensure(sample, None, VOCAB, 0.2)[2]  # another split

    sample.write_text(sample.read_text(encoding="utf-8") + "One more line.\n", encoding="utf-8")
    changed = bpe_tokens.ensure(sample, None, VOCAB, 0.2)
    assert changed[2] and changed[0].index["key"]["source_sha256"] == _sha(sample)
    assert _sha(sample) != cache.index["key"]["source_sha256"]


# -- directory sources -----------------------------------------------------------------------
def test_a_directory_is_its_sorted_txt_files_joined(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b.txt").write_text("second " * 300, encoding="utf-8")
    (root / "a.txt").write_text("first " * 300, encoding="utf-8")
    (root / "sub" / "c.txt").write_text("third " * 300, encoding="utf-8")
    (root / ".hidden.txt").write_text("hidden", encoding="utf-8")
    (root / ".git" / "x.txt").write_text("hidden too", encoding="utf-8")
    (root / "notes.md").write_text("not text", encoding="utf-8")
    source = text_source.scan(root)
    assert [rel for rel, *_ in source.files] == ["a.txt", "b.txt", "sub/c.txt"]
    joined = text_source.read_text(source)
    assert joined == "\n\n".join(("first " * 300, "second " * 300, "third " * 300))
    listing = "".join(f"{_sha(root / rel)}  {rel}\n" for rel in ("a.txt", "b.txt", "sub/c.txt"))
    assert source.sha256 == hashlib.sha256(listing.encode()).hexdigest() and source.nbytes == len(joined)
    assert text_source.scan(root / "a.txt").sha256 == _sha(root / "a.txt")  # a file: its bytes' sha256

    cache, tok_path, _ = bpe_tokens.ensure(root, None, VOCAB, 0.1)
    assert tok_path == tmp_path / "corpus.bpe300.tokenizer.json" and cache.path.parent == tmp_path
    assert (
        cache.path.name.startswith("corpus.bpe300-") and cache.index["key"]["source_sha256"] == source.sha256
    )

    (root / "sub" / "bad.txt").write_bytes(b"fine\n" + b"\xff broken")
    with pytest.raises(
        DataError, match=f"data.path {root / 'sub' / 'bad.txt'} is not UTF-8 text: .* at byte 5$"
    ):
        text_source.scan(root)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="without any"):
        text_source.scan(tmp_path / "empty")


# -- the tokenizer itself --------------------------------------------------------------------
def test_round_trip_and_chunked_encoding_equal_the_whole():
    text = SAMPLE.read_text(encoding="utf-8")
    tok = bpe.train_tokenizer([text], VOCAB)
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < VOCAB and len(ids) < len(text.encode()) / 1.5
    odd = "Rank zero → “naïve” 漢字 🙂\n  \n\tend"
    assert tok.decode(tok.encode(odd)) == odd
    assert tok.eos_id == 0 and tok.encode(bpe.EOS) == [0]


def test_chunked_encoding_equals_whole_text_encoding():
    # Whitespace runs across line ends, which a cut after every newline would split differently
    # once the tokenizer has merges for them (it does, trained on this text).
    spaced = "".join(
        f"line {i} ends in spaces  \n  \n\n indented {i}\n\t\ttabbed \nplain line\n" for i in range(300)
    )
    tok = bpe.train_tokenizer([SAMPLE.read_text(encoding="utf-8") + spaced], 400)
    whole = tok.hf_tokenizer.encode(spaced).ids
    pieces = list(bpe.chunks(spaced, 50))
    assert len(pieces) == 300 and "".join(pieces) == spaced
    assert [i for piece in pieces for i in tok.hf_tokenizer.encode(piece).ids] == whole
    lines = spaced.splitlines(keepends=True)
    at_every_newline = [i for line in lines for i in tok.hf_tokenizer.encode(line).ids]
    assert at_every_newline != whole, "this text no longer shows why the cut must be a safe one"


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_autotokenizer_reads_the_saved_directory_and_encodes_the_same_ids(tmp_path):
    tok = bpe.train_tokenizer([SAMPLE.read_text(encoding="utf-8")], VOCAB)
    saved = bpe.save_tokenizer_dir(tok, tmp_path / "tokenizer")
    assert bpe.tokenizer_sha256(saved) == tok.sha256
    text = SAMPLE.read_text(encoding="utf-8")[:4000] + " naïve 🙂 " + bpe.EOS
    script = (
        "import json, sys\nfrom transformers import AutoTokenizer\n"
        "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "print(json.dumps([t(sys.argv[2])['input_ids'], t.eos_token_id, len(t)]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(saved), text],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    ids, eos, size = json.loads(proc.stdout.splitlines()[-1])
    assert ids == tok.encode(text) and eos == tok.eos_id and size == tok.vocab_size


def test_without_tokenizers_bpe_is_one_config_error_line_and_the_byte_path_still_works(
    monkeypatch, sample, capsys
):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now fails
    for attempt in (
        lambda: bpe.train_tokenizer(["some text"], VOCAB),
        lambda: bpe_tokens.ensure(sample, None, VOCAB, 0.1),
        lambda: bpe.load_tokenizer(SAMPLE),
    ):
        with pytest.raises(DataError) as err:
            attempt()
        assert str(err.value) == bpe.MISSING_EXTRA
    bpe_tree = compose_tree(["data=text", *BPE_KEYS, f"data.path={sample}"])
    with pytest.raises(SystemExit) as exit_:
        train.checked_config(bpe_tree)  # what train.py runs before any worker starts
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == f"config error: {bpe.MISSING_EXTRA}\n", err
    assert "`hf` extra" in bpe.MISSING_EXTRA and "tokenizers" in bpe.MISSING_EXTRA
    byte_cfg = train.checked_config(compose_tree(["data=text", f"data.path={sample}"]))
    sources = run_ranks(_byte_source, 2, byte_cfg)  # forked: the hidden import stays hidden there
    assert sources == [{"kind": "text", "sha256": _sha(sample)}] * 2


def _byte_source(comm, cfg: RunConfig) -> dict:
    assert sys.modules["tokenizers"] is None
    return corpus.build(cfg, comm, BatchPlan(16, 2, 1))[0].source


# -- configuration -----------------------------------------------------------------------------
BPE_KEYS = ["data.tokenizer=bpe", "data.vocab_size=512", "model.vocab_size=512"]


def _cfg(overrides: list[str]) -> RunConfig:
    return RunConfig.from_dict(compose_tree(["data=text", *overrides]))


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (
            ["data.tokenizer=bpe"],
            r"data.tokenizer=bpe needs data.vocab_size: the vocabulary to train \(>= 257",
        ),
        (["data.tokenizer=bpe", "data.vocab_size=256"], "data.vocab_size must be null or an integer >= 257"),
        (
            ["data.tokenizer=bpe", "data.vocab_size=512", "model.vocab_size=256"],
            "^data.tokenizer=bpe has 512 tokens but model.vocab_size=256; leave model.vocab_size out",
        ),
        (["data.vocab_size=512"], "data.vocab_size=512 needs data.tokenizer=bpe"),
        (
            ["data.tokenizer=words"],
            r"^data.tokenizer must be bytes, bpe or the path of a tokenizer .*; words does not exist",
        ),
        (["data=synthetic", "data.tokenizer=bpe", "data.vocab_size=512"], "use it with data=text"),
    ],
)
def test_tokenizer_keys_are_validated_naming_the_key(overrides, expect):
    with pytest.raises(ConfigError, match=expect):
        _cfg(overrides)


def test_valid_bpe_config_and_unchanged_defaults(tmp_path):
    cfg = _cfg(BPE_KEYS)
    assert (cfg.data.tokenizer, cfg.data.vocab_size, cfg.model.vocab_size) == ("bpe", 512, 512)
    assert (_cfg([]).data.tokenizer, _cfg([]).data.vocab_size) == ("bytes", None)
    (tmp_path / "docs").mkdir()  # a directory passes the pre-launch check only with bpe
    (tmp_path / "docs" / "a.txt").write_text("text " * 100)
    corpus.check_source(_cfg([*BPE_KEYS, f"data.path={tmp_path / 'docs'}"]))
    with pytest.raises(DataError, match="not a regular file"):
        corpus.check_source(_cfg([f"data.path={tmp_path / 'docs'}"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="without any"):
        corpus.check_source(_cfg([*BPE_KEYS, f"data.path={tmp_path / 'empty'}"]))


def _load_expect_error(comm, cfg: DataConfig) -> str:
    try:
        bpe_tokens.load(cfg, 16, comm)
    except DataError as exc:
        return str(exc)
    return "no error"


def test_a_failed_build_on_rank0_is_the_same_error_on_every_rank(sample, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    cfg = DataConfig(
        kind="text",
        path=str(sample),
        cache_dir=str(blocked / "cache"),
        val_fraction=0.1,
        tokenizer="bpe",
        vocab_size=VOCAB,
    )
    messages = run_ranks(_load_expect_error, 2, cfg)
    assert messages[0] == messages[1] and "building the token cache" in messages[0]
    assert "data.cache_dir" in messages[0]


def test_the_fit_check_names_what_differs_in_the_data_source():
    text = {"kind": "text", "sha256": "a" * 64}
    bpe_source = {**text, "tokenizer": "bpe", "tokenizer_sha256": "b" * 64}
    retrained = {**bpe_source, "tokenizer_sha256": "c" * 64}
    assert fit_check._source_change(text, {**text, "sha256": "d" * 64}) == "the text file's content changed"
    assert fit_check._source_change(bpe_source, retrained) == (
        f"the tokenizer differs: checkpoint bpe with tokenizer.json sha256 {'b' * 64}, this run bpe with "
        f"tokenizer.json sha256 {'c' * 64}"
    )
    assert fit_check._source_change(text, bpe_source) == (
        f"the tokenizer differs: checkpoint bytes, this run bpe with tokenizer.json sha256 {'b' * 64}"
    )
    both = fit_check._source_change(bpe_source, {**retrained, "sha256": "d" * 64})
    assert both.startswith("the text file's content changed; the tokenizer differs: ")
