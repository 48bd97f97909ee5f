"""An existing tokenizer's ids for a text source (``data.tokenizer=PATH``), cached.

PATH is a directory holding ``tokenizer.json`` (as transformers' ``save_pretrained`` writes it,
with its tokenizer_config.json) or the file itself. Each document (``documents``) is encoded on its
own with the tokenizer's own rule for special tokens (a Llama tokenizer puts its BOS first, as
transformers' tokenizer does) and ends with its end-of-text token: tokenizer_config.json's
``eos_token``, else the first of ``EOS_NAMES`` in its vocabulary; a tokenizer without one is
refused, since nothing would mark where one document ends and the next begins.

The tokens are cached as a version-2 token file (``bpe_tokens``' format: the source's and the
tokenizer's sha256, where the held-out documents start) named by the tokenizer's sha256, next to
the source or in ``data.cache_dir``; it is reused while the source, the tokenizer, the held-out
document count and ``RECIPE`` match, and rebuilt (through a temp file and a rename) otherwise.
Rank 0 builds it and copies the tokenizer's files into ``<run dir>/tokenizer/``, which every
checkpoint carries and the export copies; the data source it records names the tokenizer by its
sha256, so a resume with another tokenizer is refused.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np

from distlib.app.config.data_group import DataConfig, id_range, tokenizer_json
from distlib.app.data import bpe, bpe_tokens, documents, parquet_column, text_source
from distlib.app.data.tokens import DataError, built_by_rank0
from distlib.comm import agree
from distlib.comm.group import Comm

RECIPE = 1  # bump when what a given source and tokenizer encode into changes
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class PretrainedTokenizer:
    """The tokenizer at ``path``: its sha256 (of tokenizer.json's bytes) and end-of-text id."""

    def __init__(self, path: str | Path):
        self.path, self.file = Path(path).expanduser(), tokenizer_json(path)
        self.hf_tokenizer = bpe.load_tokenizer(self.file).hf_tokenizer
        self.sha256 = bpe.tokenizer_sha256(self.file)
        self.eos_id = self._eos_id()

    def _named(self, role: str) -> str | None:
        """The token tokenizer_config.json names for ``role`` ("bos_token", "eos_token"), if any."""
        config = self.file.parent / "tokenizer_config.json"
        named = json.loads(config.read_text()).get(role) if config.is_file() else None
        return named.get("content") if isinstance(named, dict) else named

    @property
    def bos_id(self) -> int | None:
        named = self._named("bos_token")
        return self.hf_tokenizer.token_to_id(named) if named else None

    def _eos_id(self) -> int:
        named = self._named("eos_token")
        for name in ([named] if named else []) + list(EOS_NAMES):
            found = self.hf_tokenizer.token_to_id(name)
            if found is not None:
                return found
        raise DataError(
            f"data.tokenizer={self.path}: the tokenizer has no end-of-text token (tokenizer_config.json's "
            f"eos_token, or one of {', '.join(EOS_NAMES)}): documents need one to end"
        )

    def encode_document(self, text: str) -> list[int]:
        """The document's ids, its special tokens as the tokenizer adds them, then end-of-text."""
        with bpe.serial():
            ids = self.hf_tokenizer.encode(text).ids
        return ids if ids and ids[-1] == self.eos_id else [*ids, self.eos_id]

    def save_dir(self, out: Path) -> None:
        """Copy tokenizer.json and the files transformers reads beside it into ``out``."""
        out.mkdir(parents=True, exist_ok=True)
        for name in bpe.TOKENIZER_FILES:
            if (self.file.parent / name).is_file():
                shutil.copyfile(self.file.parent / name, out / name)


def cache_path(source: Path, cache_dir: str | None, tokenizer_sha256: str) -> Path:
    directory = Path(cache_dir) if cache_dir else source.resolve().parent
    return directory / f"{source.resolve().name}.tok-{tokenizer_sha256[:16]}.tokens"


def ensure(d: DataConfig, tokenizer: PretrainedTokenizer, vocab: int) -> tuple[Path, bool]:
    """The token file of ``d``'s source, encoded unless an up-to-date one exists; whether built."""
    source = text_source.scan(d.path, documents.SUFFIXES)
    target = cache_path(source.root, d.cache_dir, tokenizer.sha256)
    texts = list(documents.documents(source, d.text_field))
    held = documents.held_out_count([len(t.encode("utf-8")) for t in texts], d.val_fraction)
    try:
        h = bpe_tokens.read_header(target)
        if (h.source_sha256, h.tokenizer_sha256, h.split_byte, h.recipe) == (
            source.sha256,
            tokenizer.sha256,
            len(texts) - held,
            RECIPE,
        ):
            return target, False
    except (DataError, OSError):
        pass  # missing, foreign or damaged: rebuild
    train = [i for t in texts[: len(texts) - held] for i in tokenizer.encode_document(t)]
    val = [i for t in texts[len(texts) - held :] for i in tokenizer.encode_document(t)]
    target.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "source_sha256": source.sha256,
        "tokenizer_sha256": tokenizer.sha256,
        "val_start": len(train),
        "split_byte": len(texts) - held,  # the held-out documents start here
    }
    bpe_tokens.write_token_file(target, np.asarray(train + val, dtype=np.int64), vocab, header, RECIPE)
    return target, True


def precheck(d: DataConfig) -> None:
    """Before any process starts (train.py): the extra is installed, the source is there."""
    bpe.hf()
    _, listed = text_source.list_files(d.path, documents.SUFFIXES)
    if (
        any(path.name.endswith(".parquet") for _, path in listed)
        and importlib.util.find_spec("pyarrow") is None
    ):
        raise DataError(
            f"data.path {d.path} holds parquet files: reading them {parquet_column.MISSING_EXTRA}"
        )


def _rank0_build(d: DataConfig, vocab: int, run_dir: Path | None) -> dict:
    tokenizer = PretrainedTokenizer(d.tokenizer)
    target, built = ensure(d, tokenizer, vocab)
    if run_dir is not None:
        tokenizer.save_dir(Path(run_dir) / "tokenizer")
    header = bpe_tokens.read_header(target)
    done = f"encoded data.path {d.path} into {target}" if built else f"reused {target}"
    print(
        f"data.tokenizer: {tokenizer.file} (sha256 {tokenizer.sha256[:12]}, end-of-text id "
        f"{tokenizer.eos_id}); {done} ({header.count} tokens, held-out from token {header.val_start})",
        flush=True,
    )
    return bpe_tokens.built_record(target, header)


def load(d: DataConfig, seq_len: int, comm: Comm, run_dir: Path | None = None) -> tuple:
    """Every rank's (training tokens, held-out tokens, source identity for the checkpoint), as
    ``bpe_tokens.load``: rank 0 builds, the others check the header it built."""
    vocab = id_range(d.tokenizer)

    built = built_by_rank0(
        lambda: _rank0_build(d, vocab, run_dir),
        comm,
        lambda exc: (
            f"data.tokenizer={d.tokenizer}: encoding data.path {d.path} failed: {type(exc).__name__}: {exc}"
        ),
    )
    tokens, header = agree.agreed(lambda: bpe_tokens.open_built(built), comm, DataError)
    source = {
        "kind": "text",
        "sha256": header.source_sha256,
        "tokenizer": "pretrained",
        "tokenizer_sha256": header.tokenizer_sha256,
    }
    train, held = tokens[: header.val_start], tokens[header.val_start :]
    bpe_tokens.check_lengths(
        len(train), len(held), d, seq_len, f"data.path {d.path} with data.tokenizer={d.tokenizer}"
    )
    return train, held, source
