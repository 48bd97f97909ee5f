"""The BPE token cache: a version-2 token file, the cached tokenizer, rank 0 builds, all check.

The version-2 token file extends ``tokens.py``'s version 1 (same first 64 bytes, so the header
size field says where the tokens start)::

    offset  size  field
         0     8  magic b"DLTOKENS"
         8     4  format version (2), little-endian uint32
        12     4  vocabulary size (data.vocab_size: every id is below it)
        16     4  bytes per token: 2 (uint16, vocab <= 65536) or 4 (uint32)
        20     4  header size (128): where the tokens start
        24     8  token count, uint64
        32    32  sha256 of the source (``text_source``: a file's bytes, or a directory's listing)
        64    32  sha256 of the tokenizer.json the tokens were encoded with
        96     8  validation start: tokens [0, this) encode the training text, the rest the
                  held-out text (each part encoded on its own: no token spans the split)
       104     8  split byte: where the held-out text starts in the source's joined text
       112     4  the training recipe (``bpe.RECIPE``)
       116    12  zero
       128     .  the tokens

Next to it (``data.cache_dir``, or the source's directory) the tokenizer it was encoded with is
cached as ``<name>.bpe<N>.tokenizer.json``. Both are reused while the header matches the source's
sha256, N, the split byte for data.val_fraction and the recipe, and the cached tokenizer's sha256
matches the header; otherwise the tokenizer is trained again on the training text only and the
text encoded again (each file written through a temp file and a rename).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distlib.app.config.data_group import DataConfig
from distlib.app.data import bpe, text_source
from distlib.app.data import tokens as v1
from distlib.app.data.tokens import DataError
from distlib.comm import agree
from distlib.comm.group import Comm

FORMAT_VERSION = 2
HEADER = struct.Struct("<8sIIIIQ32s32sQQI")
HEADER_BYTES = 128


@dataclass(frozen=True)
class BpeTokenHeader:
    vocab_size: int
    itemsize: int
    count: int
    source_sha256: str
    tokenizer_sha256: str | None  # None: a version-1 (byte-level) file
    val_start: int | None
    split_byte: int | None
    recipe: int | None

    @property
    def dtype(self) -> np.dtype:
        return np.dtype({1: np.uint8, 2: "<u2", 4: "<u4"}[self.itemsize])


def dtype_for(vocab_size: int) -> np.dtype:
    """2 bytes a token while the ids fit (vocab <= 65536: half the disk and page cache), else 4."""
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def cache_paths(source: Path, cache_dir: str | None, vocab_size: int) -> tuple[Path, Path]:
    """(token file, cached tokenizer) of ``source`` (a file or a directory, which gets them next
    to it rather than inside it)."""
    source = Path(source).expanduser()
    directory = Path(cache_dir) if cache_dir else source.resolve().parent
    base = directory / f"{source.resolve().name}.bpe{vocab_size}"
    return base.with_name(base.name + ".tokens"), base.with_name(base.name + ".tokenizer.json")


def write_token_file(
    path: Path, ids: np.ndarray, vocab_size: int, header: dict, recipe: int = bpe.RECIPE
) -> None:
    """``ids`` behind a version-2 header (``header``: the sha256s, val_start, split_byte)."""
    dtype = dtype_for(vocab_size)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")
    raw = HEADER.pack(
        v1.MAGIC,
        FORMAT_VERSION,
        vocab_size,
        dtype.itemsize,
        HEADER_BYTES,
        ids.size,
        bytes.fromhex(header["source_sha256"]),
        bytes.fromhex(header["tokenizer_sha256"]),
        header["val_start"],
        header["split_byte"],
        recipe,
    )
    bpe.write_atomic(Path(path), raw.ljust(HEADER_BYTES, b"\0") + ids.astype(dtype, copy=False).tobytes())


def read_header(path: Path) -> BpeTokenHeader:
    """The header of a version-2 token file, or of a version-1 one (``tokens.read_header``)."""
    path = Path(path)
    raw, size = v1.read_start(path, HEADER_BYTES)
    if len(raw) >= 12 and raw[:8] == v1.MAGIC and struct.unpack("<I", raw[8:12])[0] == v1.FORMAT_VERSION:
        old = v1.read_header(path)  # a byte-level file: no tokenizer, no recorded split
        return BpeTokenHeader(old.vocab_size, old.itemsize, old.count, old.source_sha256, *[None] * 4)
    if len(raw) < HEADER.size:
        raise DataError(f"token file {path} is too short for a header ({len(raw)} bytes)")
    magic, version, vocab, itemsize, offset, count, src, tok, val, cut, recipe = HEADER.unpack_from(raw)
    if magic != v1.MAGIC or version != FORMAT_VERSION or offset != HEADER_BYTES or itemsize not in (2, 4):
        raise DataError(f"{path} is not a version-{FORMAT_VERSION} token file")
    if size != HEADER_BYTES + count * itemsize or val > count:
        raise DataError(
            f"token file {path} has {size} bytes; its header promises "
            f"{HEADER_BYTES + count * itemsize} (validation from token {val} of {count})"
        )
    return BpeTokenHeader(vocab, itemsize, count, src.hex(), tok.hex(), val, cut, recipe)


def open_tokens(path: Path) -> tuple[np.ndarray, BpeTokenHeader]:
    """The tokens as a read-only memory map (either version), and the header."""
    header = read_header(path)
    start = HEADER_BYTES if header.tokenizer_sha256 is not None else v1.HEADER_BYTES
    if header.count == 0:
        return np.zeros(0, dtype=header.dtype), header
    return np.memmap(path, dtype=header.dtype, mode="r", offset=start, shape=(header.count,)), header


def _reusable(target: Path, tok_path: Path, src_sha: str, vocab: int, cut: int) -> BpeTokenHeader | None:
    try:
        h = read_header(target)
        fresh = (h.source_sha256, h.vocab_size, h.split_byte, h.recipe) == (src_sha, vocab, cut, bpe.RECIPE)
        if fresh and tok_path.is_file() and bpe.tokenizer_sha256(tok_path) == h.tokenizer_sha256:
            return h
    except (DataError, OSError):
        pass  # missing, foreign or damaged: rebuild
    return None


def mixture_paths(
    sources: list[text_source.TextSource], cuts: list[int], cache_dir: str | None, vocab_size: int
):
    """(each source's token file, the shared tokenizer) of a mixture's BPE: named by a key of every
    source's sha256 and split, so no single source's cache (another tokenizer) is overwritten, and
    by the source's place, so two sources of one name in data.cache_dir keep a file each."""
    key = hashlib.sha256(json.dumps([[s.sha256, cut] for s, cut in zip(sources, cuts)]).encode()).hexdigest()
    tag = f"mix-{key[:16]}"
    files = [cache_paths(s.root, cache_dir, vocab_size)[0] for s in sources]
    tokens = [f.with_name(f.name.replace(".tokens", f".{tag}.{i}.tokens")) for i, f in enumerate(files)]
    directory = Path(cache_dir) if cache_dir else sources[0].root.resolve().parent
    return tokens, directory / f"{tag}.bpe{vocab_size}.tokenizer.json"


def ensure(
    path: str | Path, cache_dir: str | None, vocab_size: int, val_fraction: float
) -> tuple[Path, Path, BpeTokenHeader, bool]:
    """Train and encode unless an up-to-date cache exists. Returns (token file, cached tokenizer,
    header, whether they were (re)built)."""
    ((target, header),), tok_path, built = ensure_many([path], cache_dir, vocab_size, val_fraction)
    return target, tok_path, header, built


def ensure_many(
    paths: list[str | Path], cache_dir: str | None, vocab_size: int, val_fraction: float
) -> tuple[list[tuple[Path, BpeTokenHeader]], Path, bool]:
    """``ensure`` for the sources of a mixture (one source: its own cache): one tokenizer trained on
    every source's training text (in order, unweighted), each source encoded with it into its own
    token file. Returns ([(token file, header)] per source, cached tokenizer, whether rebuilt)."""
    sources = [text_source.scan(p) for p in paths]
    cuts = [text_source.split_byte(source, val_fraction) for source in sources]
    if len(sources) == 1:
        target, tok_path = cache_paths(sources[0].root, cache_dir, vocab_size)
        targets = [target]
    else:
        targets, tok_path = mixture_paths(sources, cuts, cache_dir, vocab_size)
    headers = [_reusable(t, tok_path, s.sha256, vocab_size, c) for t, s, c in zip(targets, sources, cuts)]
    if all(h is not None for h in headers):
        return list(zip(targets, headers)), tok_path, False
    texts = [text_source.split_text(text_source.read_text(s), cut) for s, cut in zip(sources, cuts)]
    tok = bpe.train_tokenizer([train for train, _ in texts], vocab_size)  # held-out texts never reach it
    tok_path.parent.mkdir(parents=True, exist_ok=True)
    bpe.write_atomic(tok_path, tok.serialized.encode("utf-8"))
    for target, source, cut, parts in zip(targets, sources, cuts, texts):
        train_ids, val_ids = (np.asarray(tok.encode(t), dtype=np.int64) for t in parts)
        record = {"source_sha256": source.sha256, "tokenizer_sha256": tok.sha256}
        record |= {"val_start": len(train_ids), "split_byte": cut}
        write_token_file(target, np.concatenate([train_ids, val_ids]), vocab_size, record)
    return [(t, read_header(t)) for t in targets], tok_path, True


# -- every rank's view ------------------------------------------------------------------------
def precheck(path: str) -> None:
    """Before any process starts (train.py): the extra is installed and the source is there."""
    bpe.hf()
    text_source.list_files(path)


def _rank0_build(ds: list[DataConfig], run_dir: Path | None) -> list[dict]:
    """Rank 0: the caches up to date, and the tokenizer saved as <run dir>/tokenizer/."""
    d = ds[0]
    built_all, tok_path, built = ensure_many(
        [one.path for one in ds], d.cache_dir, d.vocab_size, d.val_fraction
    )
    tok = bpe.load_tokenizer(tok_path)
    if run_dir is not None:
        bpe.save_tokenizer_dir(tok, Path(run_dir) / "tokenizer")
    if built:
        encoded = "; ".join(
            f"data.path {one.path} into {target} ({header.count} tokens, held-out from token "
            f"{header.val_start})"
            for one, (target, header) in zip(ds, built_all)
        )
        print(
            f"data.tokenizer=bpe: trained {tok_path} ({tok.vocab_size} tokens for data.vocab_size="
            f"{d.vocab_size}) and encoded {encoded}",
            flush=True,
        )
    return [built_record(target, header) for target, header in built_all]


def built_record(target: Path, header: BpeTokenHeader) -> dict:
    """What rank 0 tells the others of the token file it built (``open_built`` checks it)."""
    return {
        "target": str(target),
        "source_sha256": header.source_sha256,
        "tokenizer_sha256": header.tokenizer_sha256,
    }


def load(
    d: DataConfig, seq_len: int, comm: Comm, run_dir: Path | None = None
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Every rank's (training tokens, held-out tokens, source identity for the checkpoint). Rank 0
    builds; the others wait for its verdict, then check the header carries the same sha256s (a
    node that cannot see the cache says so). Every rank raises the same DataError on failure."""
    return load_many([d], seq_len, comm, run_dir)[0]


def load_many(ds: list[DataConfig], seq_len: int, comm: Comm, run_dir: Path | None = None) -> list[tuple]:
    """``load`` for each source of a mixture (``ds``: the run's data config once per source), all
    encoded with one tokenizer trained on them together (``ensure_many``)."""
    paths = ", ".join(str(d.path) for d in ds)
    built = v1.built_by_rank0(
        lambda: _rank0_build(ds, run_dir),
        comm,
        lambda exc: (
            f"data.tokenizer=bpe: building the token cache of data.path {paths} failed: "
            f"{type(exc).__name__}: {exc} (data.cache_dir names a writable directory for it)"
        ),
    )
    loaded = []
    for d, record in zip(ds, built):
        tokens, header = agree.agreed(lambda record=record: open_built(record), comm, DataError)
        train, held = tokens[: header.val_start], tokens[header.val_start :]
        named = f"data.path {d.path}" if len(ds) == 1 else f"data.mixture source {d.path}"
        where = f"{named} with data.tokenizer=bpe (data.vocab_size={d.vocab_size})"
        check_lengths(len(train), len(held), d, seq_len, where)
        source = {
            "kind": "text",
            "sha256": header.source_sha256,
            "tokenizer": "bpe",
            "tokenizer_sha256": header.tokenizer_sha256,
        }
        loaded.append((train, held, source))
    return loaded


def open_built(built: dict) -> tuple[np.ndarray, BpeTokenHeader]:
    """The token file rank 0 built (``built``: its path and sha256s), checked to be that one: a
    node that cannot see the same cache directory says so."""
    target = Path(built["target"])
    tokens, header = open_tokens(target)
    shas = (header.source_sha256, header.tokenizer_sha256)
    if shas != (built["source_sha256"], built["tokenizer_sha256"]):
        raise DataError(
            f"token file {target} holds source/tokenizer sha256 {header.source_sha256}/"
            f"{header.tokenizer_sha256}, rank 0 built {built['source_sha256']}/"
            f"{built['tokenizer_sha256']}; every node must see the same cache directory"
        )
    return tokens, header


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
