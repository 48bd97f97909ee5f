"""The BPE token caches: the tokenizer trained by rank 0, the tokens encoded by every rank.

``data.tokenizer=bpe data.vocab_size=N``, for ``data.path`` or every source of ``data.mixture``:

1. Rank 0 looks for an up-to-date cache: the cached tokenizer (``<name>.bpe<N>.tokenizer.json``
   next to the source or in ``data.cache_dir``; a mixture's is ``mix-<key>.bpe<N>.tokenizer.json``
   next to its first source, the key hashing every source's sha256 and split) and, for each
   source, a token cache in shards (``token_shards``) named by that tokenizer's sha256, whose index
   names the source's sha256, the split byte, N, ``bpe.RECIPE`` and the tokenizer. Anything
   missing or stale: the tokenizer is trained again on the training text of every source, in order
   (the held-out tails never reach it), and written through a temp file and a rename.
2. Every rank encodes its block of each stale source (``token_shards.build``: same bytes at any
   world size, built in a temporary directory renamed into place whole). The documents are the
   source's text cut at ``bpe.chunks``' safe places, the training text's pieces then the held-out
   text's: encoding them one by one gives exactly the whole text's tokens (the cut is one the
   GPT-2 regex makes anyway), so the held-out tokens start where the held-out pieces do and no
   token spans the split. Every rank reads the source's text to cut it, as rank 0 does to train.
3. Every rank maps the shards, and rank 0 copies the tokenizer into ``<run dir>/tokenizer/``.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from pathlib import Path

from distlib.app.config.data_group import DataConfig
from distlib.app.data import bpe, text_source, token_shards
from distlib.app.data import tokens as v1
from distlib.app.data.tokens import DataError
from distlib.comm import agree
from distlib.comm.group import Comm

ONE = Comm(ranks=(0,), rank=0)  # a single process's own world


def _directory(source: text_source.TextSource, cache_dir: str | None) -> Path:
    return Path(cache_dir) if cache_dir else source.root.resolve().parent


def tokenizer_path(sources: list, cuts: list[int], cache_dir: str | None, vocab_size: int) -> Path:
    """Where the tokenizer of ``sources`` (split at ``cuts``) is cached: a source's own, or a
    mixture's, named by a key of every source's sha256 and split (so never a source's own)."""
    if len(sources) == 1:
        return (
            _directory(sources[0], cache_dir)
            / f"{sources[0].root.resolve().name}.bpe{vocab_size}.tokenizer.json"
        )
    listed = json.dumps([[source.sha256, cut] for source, cut in zip(sources, cuts)])
    key = hashlib.sha256(listed.encode()).hexdigest()[:16]
    return _directory(sources[0], cache_dir) / f"mix-{key}.bpe{vocab_size}.tokenizer.json"


def shards_path(source, cache_dir: str | None, vocab_size: int, tokenizer_sha256: str, place=None) -> Path:
    """The token cache of ``source`` encoded by the tokenizer of ``tokenizer_sha256``; a mixture's
    ``place`` keeps two sources of one name in one data.cache_dir apart."""
    tail = "" if place is None else f".{place}"
    name = f"{source.root.resolve().name}.bpe{vocab_size}-{tokenizer_sha256[:16]}{tail}.shards"
    return _directory(source, cache_dir) / name


def cache_key(source, cut: int, vocab_size: int, tokenizer_sha256: str) -> dict:
    return {
        "source_sha256": source.sha256,
        "split_byte": cut,
        "vocab_size": vocab_size,
        "recipe": bpe.RECIPE,
        "tokenizer_sha256": tokenizer_sha256,
    }


def pieces(source, cut: int) -> itertools.chain:
    """The source's documents for the cache: its training text's safe pieces, then its held-out
    text's (``bpe.chunks``). DataError if a file changed since the source was hashed."""
    train, held = text_source.split_text(text_source.read_text(source), cut)
    return itertools.chain(bpe.chunks(train, bpe.CHUNK_CHARS), bpe.chunks(held, bpe.CHUNK_CHARS))


def _survey(paths: list, cache_dir: str | None, vocab_size: int, val_fraction: float) -> dict:
    """Rank 0: the sources hashed and split, the tokenizer up to date (trained again unless every
    source's cache names it), and what each source needs built."""
    sources = [text_source.scan(p) for p in paths]
    cuts = [text_source.split_byte(source, val_fraction) for source in sources]
    places = [None] if len(sources) == 1 else list(range(len(sources)))
    texts = functools.cache(lambda i: text_source.split_text(text_source.read_text(sources[i]), cuts[i]))
    tok_path = tokenizer_path(sources, cuts, cache_dir, vocab_size)

    def caches(sha: str) -> list[tuple[Path, dict]]:
        return [
            (shards_path(s, cache_dir, vocab_size, sha, at), cache_key(s, c, vocab_size, sha))
            for s, c, at in zip(sources, cuts, places)
        ]

    sha = bpe.tokenizer_sha256(tok_path) if tok_path.is_file() else None
    trained = sha is None or any(token_shards.open_cache(*one) is None for one in caches(sha))
    if trained:
        sha = _train(tok_path, [texts(i)[0] for i in range(len(sources))], vocab_size)
    builds = [
        {
            "target": str(target),
            "key": key,
            "build": _pending(target, key, texts, i),
            "source": text_source.record(s),
        }
        for i, (s, (target, key)) in enumerate(zip(sources, caches(sha)))
    ]
    return {"tokenizer": str(tok_path), "tokenizer_sha256": sha, "trained": trained, "sources": builds}


def _train(tok_path: Path, texts: list[str], vocab_size: int) -> str:
    """Rank 0: the tokenizer trained on ``texts`` and written to ``tok_path``; its sha256."""
    tok = bpe.train_tokenizer(texts, vocab_size)
    tok_path.parent.mkdir(parents=True, exist_ok=True)
    bpe.write_atomic(tok_path, tok.serialized.encode("utf-8"))
    return tok.sha256


def _pending(target: Path, key: dict, texts, i: int) -> dict | None:
    """None while source ``i``'s cache is up to date, else its build: a fresh directory, and its
    pieces counted (``texts(i)``: its training and held-out text)."""
    if token_shards.open_cache(target, key) is not None:
        return None
    count, held = (sum(1 for _ in bpe.chunks(t, bpe.CHUNK_CHARS)) for t in texts(i))
    return {"tmp": str(token_shards.temporary_dir(target)), "documents": count + held, "held": held}


def ensure_many(
    paths: list, cache_dir: str | None, vocab_size: int, val_fraction: float, comm: Comm = ONE, say=print
) -> tuple[list[token_shards.Cache], Path, bool]:
    """The token caches of ``paths`` (collective over ``comm``): one tokenizer for them all, each
    source's tokens reused if up to date, else encoded by every rank. Returns (each source's
    cache, the cached tokenizer, whether anything was trained or encoded)."""
    survey = v1.built_by_rank0(
        lambda: _survey(paths, cache_dir, vocab_size, val_fraction),
        comm,
        lambda exc: f"{type(exc).__name__}: {exc} (data.cache_dir names a writable directory for it)",
    )
    tok_path = Path(survey["tokenizer"])
    if survey["trained"] and comm.rank == 0:
        say(f"data.tokenizer=bpe: trained {tok_path} on the training text of {', '.join(map(str, paths))}")
    tok = agree.agreed(lambda: _same_tokenizer(tok_path, survey["tokenizer_sha256"]), comm, DataError)
    for one in survey["sources"]:
        if one["build"] is not None:
            source, cut = text_source.from_record(one["source"]), one["key"]["split_byte"]
            b = one["build"]
            plan = token_shards.Plan(
                Path(one["target"]), Path(b["tmp"]), b["documents"], b["held"], one["key"], vocab_size
            )
            token_shards.build(
                plan, lambda source=source, cut=cut: pieces(source, cut), tok.encode, comm, say
            )
    caches = [
        agree.agreed(
            lambda one=one: token_shards.open_built(Path(one["target"]), one["key"]), comm, DataError
        )
        for one in survey["sources"]
    ]
    built = survey["trained"] or any(one["build"] is not None for one in survey["sources"])
    return caches, tok_path, built


def _same_tokenizer(path: Path, sha256: str) -> bpe.BpeTokenizer:
    tok = bpe.load_tokenizer(path)
    if tok.sha256 != sha256:
        raise DataError(
            f"tokenizer {path} has sha256 {tok.sha256} on this node, rank 0 has {sha256}: every node "
            f"must see the same cache directory"
        )
    return tok


def ensure(
    path, cache_dir: str | None, vocab_size: int, val_fraction: float, comm: Comm = ONE
) -> tuple[token_shards.Cache, Path, bool]:
    """``ensure_many`` of one source: (its cache, the cached tokenizer, whether built)."""
    (cache,), tok_path, built = ensure_many([path], cache_dir, vocab_size, val_fraction, comm)
    return cache, tok_path, built


# -- every rank's view ------------------------------------------------------------------------
def precheck(path: str) -> None:
    """Before any process starts (train.py): the extra is installed and the source is there."""
    bpe.hf()
    text_source.list_files(path)


def load(d: DataConfig, seq_len: int, comm: Comm, run_dir: Path | None = None) -> tuple:
    """Every rank's (training tokens, held-out tokens, source identity for the checkpoint); every
    rank raises the same DataError on failure."""
    return load_many([d], seq_len, comm, run_dir)[0]


def load_many(ds: list[DataConfig], seq_len: int, comm: Comm, run_dir: Path | None = None) -> list[tuple]:
    """``load`` for each source of a mixture (``ds``: the run's data config once per source), all
    encoded with one tokenizer trained on them together (``ensure_many``); rank 0 says what it
    trained and encoded, and saves the tokenizer in the run directory."""
    d, paths = ds[0], ", ".join(str(one.path) for one in ds)
    try:
        caches, tok_path, built = ensure_many(
            [one.path for one in ds], d.cache_dir, d.vocab_size, d.val_fraction, comm
        )
    except DataError as exc:
        raise DataError(
            f"data.tokenizer=bpe: building the token cache of data.path {paths} failed: {exc}"
        ) from exc
    if comm.rank == 0:
        _report(ds, caches, tok_path, built, run_dir)
    loaded = []
    for one, cache in zip(ds, caches):
        tokens = cache.tokens()
        train, held = tokens[: cache.val_start], tokens[cache.val_start :]
        named = f"data.path {one.path}" if len(ds) == 1 else f"data.mixture source {one.path}"
        check_lengths(
            len(train),
            len(held),
            one,
            seq_len,
            f"{named} with data.tokenizer=bpe (data.vocab_size={one.vocab_size})",
        )
        key = cache.index["key"]
        source = {"kind": "text", "sha256": key["source_sha256"], "tokenizer": "bpe"}
        loaded.append((train, held, source | {"tokenizer_sha256": key["tokenizer_sha256"]}))
    return loaded


def _report(ds: list[DataConfig], caches: list, tok_path: Path, built: bool, run_dir: Path | None) -> None:
    tok = bpe.load_tokenizer(tok_path)
    if run_dir is not None:
        bpe.save_tokenizer_dir(tok, Path(run_dir) / "tokenizer")
    if built:
        encoded = "; ".join(
            f"data.path {one.path} into {cache.path} ({cache.index['count']} tokens in "
            f"{len(cache.index['shards'])} shard(s), held-out from token {cache.val_start})"
            for one, cache in zip(ds, caches)
        )
        print(
            f"data.tokenizer=bpe: {tok_path} ({tok.vocab_size} tokens for data.vocab_size="
            f"{ds[0].vocab_size}); encoded {encoded}",
            flush=True,
        )


def check_lengths(train: int, held: int, d: DataConfig, seq_len: int, where: str) -> None:
    """One training sequence at least, and one held-out one when data.val_fraction asks for it."""
    if train < seq_len + 1:
        raise DataError(
            f"{where} gives {train} training tokens; a training sequence needs model.seq_len "
            f"+ 1 = {seq_len + 1}: use more data or a shorter model.seq_len"
        )
    if d.val_fraction > 0 and held < seq_len + 1:
        raise DataError(
            f"{where} gives {held} held-out tokens for data.val_fraction={d.val_fraction}: "
            f"fewer than one validation sequence of model.seq_len + 1 = {seq_len + 1}; raise "
            f"data.val_fraction or use more data"
        )
