"""An existing tokenizer's ids for a text source (``data.tokenizer=PATH``), cached.

PATH is a directory holding ``tokenizer.json`` (as transformers' ``save_pretrained`` writes it,
with its tokenizer_config.json) or the file itself. Each document (``documents``) is encoded on its
own with the tokenizer's own rule for special tokens (a Llama tokenizer puts its BOS first, as
transformers' tokenizer does) and ends with its end-of-text token: tokenizer_config.json's
``eos_token``, else the first of ``EOS_NAMES`` in its vocabulary; a tokenizer without one is
refused, since nothing would mark where one document ends and the next begins.

The tokens are cached in shards (``token_shards``: every rank encodes its block of the documents,
the bytes the same at any world size, the directory renamed into place whole), named by the
tokenizer's sha256, next to the source or in ``data.cache_dir``; the cache is reused while the
source, the tokenizer, the document and held-out document counts and ``RECIPE`` match, and rebuilt
otherwise. Rank 0 hashes the source and counts its documents first (the held-out ones are the
last whole documents), and copies the tokenizer's files into ``<run dir>/tokenizer/``, which every
checkpoint carries and the export copies; the data source it records names the tokenizer by its
sha256, so a resume with another tokenizer is refused.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from array import array
from pathlib import Path

from distlib.app.config.data_group import DataConfig, id_range, tokenizer_json
from distlib.app.data import bpe, bpe_tokens, documents, parquet_column, text_source, token_shards
from distlib.app.data.tokens import DataError
from distlib.comm import agree
from distlib.comm.group import Comm

ONE = Comm(ranks=(0,), rank=0)  # a single process's own world

RECIPE = 2  # bump when what a given source and tokenizer encode into changes (2: jsonl lines end at \n only)
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
    return directory / f"{source.resolve().name}.tok-{tokenizer_sha256[:16]}.shards"


def _survey(d: DataConfig, tokenizer: PretrainedTokenizer) -> dict:
    """Rank 0: the source hashed, its documents counted and sized (the held-out ones are the last
    whole documents), and whether an up-to-date cache exists (else a fresh build directory)."""
    source = text_source.scan(d.path, documents.SUFFIXES)
    sizes = array("Q", (len(t.encode("utf-8")) for t in documents.documents(source, d.text_field)))
    held = documents.held_out_count(sizes, d.val_fraction)
    key = {
        "source_sha256": source.sha256,
        "tokenizer_sha256": tokenizer.sha256,
        "recipe": RECIPE,
        "documents": len(sizes),
        "held_documents": held,
    }
    target = cache_path(source.root, d.cache_dir, tokenizer.sha256)
    fresh = token_shards.open_cache(target, key) is None
    tmp = str(token_shards.temporary_dir(target)) if fresh else None
    return {"target": str(target), "key": key, "tmp": tmp, "source": text_source.record(source)}


def ensure(
    d: DataConfig, tokenizer: PretrainedTokenizer, vocab: int, comm: Comm = ONE, say=print
) -> tuple[token_shards.Cache, bool]:
    """The token cache of ``d``'s source (collective over ``comm``): reused if up to date, else
    encoded by every rank in parallel (``token_shards``); whether it was built."""
    survey = agree.agreed(lambda: _survey(d, tokenizer), comm, DataError, rank0_only=True)
    target, key = Path(survey["target"]), survey["key"]
    if survey["tmp"] is not None:
        plan = token_shards.Plan(
            target, Path(survey["tmp"]), key["documents"], key["held_documents"], key, vocab
        )
        docs = lambda: documents.documents(text_source.from_record(survey["source"]), d.text_field)  # noqa: E731
        token_shards.build(plan, docs, tokenizer.encode_document, comm, say)

    opened = agree.agreed(lambda: token_shards.open_built(target, key), comm, DataError)
    return opened, survey["tmp"] is not None


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


def load(d: DataConfig, seq_len: int, comm: Comm, run_dir: Path | None = None) -> tuple:
    """Every rank's (training tokens, held-out tokens, source identity for the checkpoint, the
    end-of-text id that ends each document): the token cache (``ensure``), its held-out tokens from
    the first held-out document on; rank 0 saves the tokenizer into the run directory and says which
    it used."""
    vocab = id_range(d.tokenizer)
    tokenizer = agree.agreed(lambda: PretrainedTokenizer(d.tokenizer), comm, DataError)
    where = f"data.tokenizer={d.tokenizer}: encoding data.path {d.path}"
    try:
        cache, built = ensure(d, tokenizer, vocab, comm)
    except DataError as exc:
        raise DataError(f"{where} failed: {exc}") from exc
    count = cache.index["count"]
    if comm.rank == 0:
        if run_dir is not None:
            tokenizer.save_dir(Path(run_dir) / "tokenizer")
        done = f"encoded data.path {d.path} into {cache.path}" if built else f"reused {cache.path}"
        print(
            f"data.tokenizer: {tokenizer.file} (sha256 {tokenizer.sha256[:12]}, end-of-text id "
            f"{tokenizer.eos_id}); {done} ({count} tokens in {len(cache.index['shards'])} shard(s), "
            f"held-out from token {cache.val_start})",
            flush=True,
        )
    tokens = cache.tokens()
    source = {
        "kind": "text",
        "sha256": cache.index["key"]["source_sha256"],
        "tokenizer": "pretrained",
        "tokenizer_sha256": tokenizer.sha256,
    }
    train, held = tokens[: cache.val_start], tokens[cache.val_start :]
    bpe_tokens.check_lengths(
        len(train), len(held), d, seq_len, f"data.path {d.path} with data.tokenizer={d.tokenizer}"
    )
    return train, held, source, tokenizer.eos_id
