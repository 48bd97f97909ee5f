"""Which corpus a run reads: checked before any process starts (``check_source``), then built on
every rank (``build``): the synthetic corpus, a text as byte-level, BPE or an existing tokenizer's
tokens, or a mixture of texts (``data.mixture``, ``mixture.MixedBatches``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from distlib.app.data import bpe_tokens, documents, pretrained
from distlib.app.data.batches import BatchPlan, GlobalBatches, HeldOut, make_corpus, split_heldout
from distlib.app.data.mixture import MixedBatches, MixedHeldOut, SourceWindows
from distlib.app.data.tokens import DataError, load_text_tokens
from distlib.comm.group import Comm

if TYPE_CHECKING:
    from distlib.app.config.run import RunConfig


def _check_lengths(total: int, cfg: RunConfig, where: str) -> None:
    d, seq = cfg.data, cfg.model.seq_len
    train = total - int(total * d.val_fraction)
    held = total - train
    if train < seq + 1:
        split = f" (its training split is {train} after data.val_fraction={d.val_fraction})" if held else ""
        raise DataError(
            f"{where} has {total} tokens{split}; a training sequence needs model.seq_len + 1 = "
            f"{seq + 1}: use more data or a shorter model.seq_len"
        )
    if d.val_fraction > 0 and held < seq + 1:
        raise DataError(
            f"{where} has {total} tokens, so data.val_fraction={d.val_fraction} holds out {held}: "
            f"fewer than one validation sequence of model.seq_len + 1 = {seq + 1} tokens; raise "
            f"data.val_fraction or use more data"
        )


def check_source(cfg: RunConfig) -> None:
    """Cheap checks before any process starts: the text file (each of a mixture's) exists, is not
    empty and is long enough for the sequence length and the held-out split. Raises DataError."""
    for one in _each_source(cfg):
        _check_one(one)


def _each_source(cfg: RunConfig) -> list[RunConfig]:
    """The run's configuration once per text source of a mixture (with that one as data.path), or
    as it is."""
    d = cfg.data
    if d.mixture is None or d.kind != "text":
        return [cfg]
    return [
        dataclasses.replace(cfg, data=dataclasses.replace(d, path=p, mixture=None, weights=None))
        for p in d.mixture
    ]


def _check_one(cfg: RunConfig) -> None:
    d = cfg.data
    if d.kind != "text":
        _check_lengths(d.total_tokens, cfg, "the synthetic corpus (data.total_tokens)")
        return
    if not d.pretrained and Path(d.path).name.endswith(documents.RECORDS):
        raise DataError(
            f"data.path {d.path} holds documents as records: data.tokenizer={d.tokenizer} reads plain text "
            f"and would train on their syntax; read them with an existing tokenizer, data.tokenizer=PATH "
            f"(a directory with tokenizer.json; model.init_from=DIR's by default)"
        )
    if d.tokenizer == "bpe":  # token counts are known after training and encoding: bpe_tokens.load
        bpe_tokens.precheck(d.path)
        return
    if d.pretrained:  # and after encoding: pretrained.load
        pretrained.precheck(d)
        return
    path = Path(d.path).expanduser()
    if not path.exists():
        raise DataError(
            f"data.path {path} does not exist (relative paths start at the launch directory {Path.cwd()})"
        )
    if not path.is_file():
        raise DataError(f"data.path {path} is not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"data.path {path} is empty: there is nothing to train on")
    _check_lengths(size, cfg, f"data.path {path}")


def build(
    cfg: RunConfig, comm: Comm, plan: BatchPlan, run_dir: Path | None = None
) -> tuple[GlobalBatches, HeldOut | None]:
    """This run's training batches and (when data.val_fraction > 0) its held-out windows.
    ``run_dir``: where rank 0 saves a BPE run's tokenizer (``<run_dir>/tokenizer``)."""
    if cfg.data.mixture is not None:
        return _mixed(cfg, comm, plan, run_dir)
    d, seq = cfg.data, cfg.model.seq_len
    if d.pretrained:  # split by documents
        train, held, source, end = pretrained.load(d, seq, comm, run_dir)
        heldout = HeldOut(held, seq, cfg.train.eval_windows) if d.val_fraction > 0 else None
        return GlobalBatches(train, seq, plan, cfg.seed, source, _ends(d, end)), heldout
    if d.kind == "text" and d.tokenizer == "bpe":  # split at a character
        train, held, source = bpe_tokens.load(d, seq, comm, run_dir)
        heldout = HeldOut(held, seq, cfg.train.eval_windows) if d.val_fraction > 0 else None
        return GlobalBatches(train, seq, plan, cfg.seed, source), heldout
    if d.kind == "text":
        tokens, sha = load_text_tokens(d.path, d.cache_dir, comm)
        source, where = {"kind": "text", "sha256": sha}, f"data.path {d.path}"
    else:
        tokens = make_corpus(d.seed, d.total_tokens, cfg.model.vocab_size, d.follow_prob)
        source, where = None, "the synthetic corpus (data.total_tokens)"
    _check_lengths(len(tokens), cfg, where)
    train, held = split_heldout(tokens, d.val_fraction)
    heldout = HeldOut(held, seq, cfg.train.eval_windows) if d.val_fraction > 0 else None
    return GlobalBatches(train, seq, plan, cfg.seed, source), heldout


def _mixed(cfg: RunConfig, comm: Comm, plan: BatchPlan, run_dir: Path | None) -> tuple:
    """data.mixture's batches and held-out windows: each source tokenized and split on its own (as
    data.path alone would be)."""
    d, seq = cfg.data, cfg.model.seq_len
    ones, end = _each_source(cfg), None
    if d.tokenizer == "bpe":  # one tokenizer trained on every source's training text
        loaded = bpe_tokens.load_many([one.data for one in ones], seq, comm, run_dir)
    else:
        loaded = [_one_source(one, cache_dir, comm, run_dir) for one, cache_dir in zip(ones, _cache_dirs(d))]
        end = loaded[0][3]  # one tokenizer for every source: one end-of-text id (None: bytes)
    sources = [SourceWindows(train, seq, cfg.seed, s) for s, (train, *_) in enumerate(loaded)]
    helds, identities = [one[1] for one in loaded], [one[2] for one in loaded]
    identity = {"kind": "mixture", "sources": identities}
    batches = MixedBatches(sources, d.shares, plan, cfg.seed, identity, _ends(d, end))
    heldout = MixedHeldOut(helds, seq, cfg.train.eval_windows, d.shares) if d.val_fraction > 0 else None
    return batches, heldout


def _cache_dirs(d) -> list[str | None]:
    """Each mixture source's cache directory: data.cache_dir, except that sources whose file names
    clash there get ``source-<i>/`` in it (each cache is named after its source's file: one name
    would make each source's build replace the other's, every run)."""
    names = [Path(p).expanduser().resolve().name for p in d.mixture]
    if d.cache_dir is None:
        return [None] * len(names)
    return [
        str(Path(d.cache_dir) / f"source-{i}") if names.count(name) > 1 else d.cache_dir
        for i, name in enumerate(names)
    ]


def _one_source(one: RunConfig, cache_dir: str | None, comm: Comm, run_dir: Path | None) -> tuple:
    """(training tokens, held-out tokens, identity, end-of-text id or None) of a mixture's source,
    cached in ``cache_dir`` (``_cache_dirs``)."""
    d = dataclasses.replace(one.data, cache_dir=cache_dir)
    if d.pretrained:
        return pretrained.load(d, one.model.seq_len, comm, run_dir)
    tokens, sha = load_text_tokens(d.path, d.cache_dir, comm)
    _check_lengths(len(tokens), one, f"data.mixture source {d.path}")
    return (*split_heldout(tokens, d.val_fraction), {"kind": "text", "sha256": sha}, None)


def _ends(d, end: int | None) -> int | None:
    """The end-of-document token that packs the sequences' documents (data.document_mask), or None."""
    return end if d.document_mask else None
