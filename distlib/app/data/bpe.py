"""A byte-level BPE tokenizer (Hugging Face ``tokenizers``), trained on the run's own text.

``data.tokenizer=bpe data.vocab_size=N``: GPT-2-style byte-level BPE. The text is split into
pre-tokens by the GPT-2 regex (``pre_tokenizers.ByteLevel``), every byte is mapped to one of 256
printable characters (so any input is representable, nothing is ever unknown), and merges are
learned until the vocabulary has N entries: ``SPECIAL_TOKENS`` first (``<|endoftext|>`` is id 0),
then the 256 byte characters, then the merges in the order learned. A small text can run out of
pairs before N; the tokenizer is then smaller than N and the model's extra rows are never used.

Determinism: ``tokenizers`` keeps its counts in Rust HashMaps seeded afresh in every process.
Its merge order is nevertheless a function of the counts alone (ties go to the smaller pair of
ids), so the hash seed does not matter: tests/test_bpe.py trains in two fresh processes and
compares the bytes. Training and encoding run with the library's parallelism off (``serial``,
whatever the caller's TOKENIZERS_PARALLELISM): a used rayon pool leaves its threads alive, and
this program forks (the launcher, the test ranks) -- a thread alive at a fork can leave a lock
held in the child.

Plain arguments in, plain values out. ``tokenizers`` is imported only when used, so the
byte-level default needs nothing beyond the base install.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from distlib.app.config.data_group import BPE_MIN_VOCAB, BYTE_VOCAB, TOKENIZER_JSON, tokenizer_json
from distlib.app.data.tokens import DataError, atomic_file

EOS = "<|endoftext|>"
SPECIAL_TOKENS = (EOS,)
assert BPE_MIN_VOCAB == BYTE_VOCAB + len(SPECIAL_TOKENS), "data.vocab_size's lower bound"
# Bump when anything below changes what a given text and N train into: cached tokenizers and
# token files record it and are rebuilt when it differs.
RECIPE = 1
MISSING_EXTRA = (
    "data.tokenizer=bpe needs the optional `hf` extra (pip install tokenizers==0.23.3), "
    "which is not installed"
)
# What AutoTokenizer.from_pretrained reads besides tokenizer.json (save_tokenizer_dir writes them).
TOKENIZER_FILES = (TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json")
# Encode in pieces of about this many characters, so a large text never becomes one giant
# Encoding (ids, offsets, token strings per token).
CHUNK_CHARS = 1 << 18
# A safe place to cut the text: after a newline that follows a non-space and precedes one. The
# GPT-2 regex then splits both sides exactly as it splits the whole (no whitespace run spans the
# cut, and the pattern has no look-behind), so chunked encoding equals whole-text encoding.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")


def hf():
    """The ``tokenizers`` module, or the one-line DataError saying which extra to install."""
    try:
        import tokenizers
    except ImportError as exc:
        raise DataError(MISSING_EXTRA) from exc
    return tokenizers


@contextmanager
def serial() -> Iterator[None]:
    """``tokenizers`` reads TOKENIZERS_PARALLELISM at every parallel call; "false" keeps the work on
    the calling thread (no rayon pool is created). The caller's value is restored afterwards."""
    key, before = "TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ[key] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, each cut at a ``_SAFE_CUT``."""
    start = 0
    while start < len(text):
        found = _SAFE_CUT.search(text, start + size) if start + size < len(text) else None
        end = found.start() if found else len(text)
        yield text[start:end]
        start = end


class BpeTokenizer:
    """Our view of a trained tokenizer: encode / decode, its size and the end-of-text id."""

    def __init__(self, tokenizer, serialized: str):
        self.hf_tokenizer = tokenizer
        self.serialized = serialized  # tokenizer.json's exact text
        self.sha256 = hashlib.sha256(serialized.encode("utf-8")).hexdigest()
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = tokenizer.token_to_id(EOS)

    def encode(self, text: str) -> list[int]:
        with serial():
            return [i for piece in chunks(text) for i in self.hf_tokenizer.encode(piece).ids]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; a byte sequence cut mid-character shows as U+FFFD (as ByteTokenizer)."""
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=False)


def _untrained(tokenizers):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    # add_prefix_space=False: the text is encoded as it is, so decode(encode(t)) == t exactly.
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> BpeTokenizer:
    """A byte-level BPE of ``vocab_size`` entries (at most) learned from ``texts`` (pieces cut
    with ``chunks``, so the pre-tokens counted are the ones encoding will see)."""
    if vocab_size < BPE_MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {BPE_MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} special)")
    tokenizers = hf()
    tok = _untrained(tokenizers)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        # all 256 byte characters, even those the text lacks: every input stays encodable
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    with serial():
        tok.train_from_iterator((piece for text in texts for piece in chunks(text)), trainer)
    return BpeTokenizer(tok, tok.to_str(pretty=True))


def tokenizer_sha256(path: str | Path) -> str:
    """sha256 of the tokenizer.json bytes (``path``: the file or its directory)."""
    return hashlib.sha256(tokenizer_json(path).read_bytes()).hexdigest()


def load_tokenizer(path: str | Path) -> BpeTokenizer:
    """The tokenizer saved at ``path`` (a tokenizer.json, or a directory holding one)."""
    file = tokenizer_json(path)
    try:
        serialized = file.read_bytes().decode("utf-8")  # bytes: no newline translation, exact sha256
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"tokenizer {file}: {getattr(exc, 'strerror', None) or exc}") from exc
    module = hf()
    try:
        return BpeTokenizer(module.Tokenizer.from_str(serialized), serialized)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own error types
        raise DataError(f"tokenizer {file} does not load: {exc}") from exc


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temp file and a rename: a reader sees old or new, whole."""
    with atomic_file(Path(path)) as f:
        f.write(data)


def save_tokenizer_dir(tokenizer: BpeTokenizer, out_dir: str | Path) -> Path:
    """``out_dir`` as ``transformers.AutoTokenizer.from_pretrained(out_dir)`` reads it: the exact
    tokenizer.json, a tokenizer_config.json naming the fast-tokenizer class and the special
    tokens (GPT-2's convention: <|endoftext|> is bos, eos and unk), special_tokens_map.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "distlib": {"recipe": RECIPE, "tokenizer_sha256": tokenizer.sha256},
    }
    texts = (tokenizer.serialized, json.dumps(config, indent=2) + "\n", json.dumps(specials, indent=2) + "\n")
    for name, text in zip(TOKENIZER_FILES, texts):
        write_atomic(out / name, text.encode("utf-8"))
    return out


def recorded_sha256(manifest: dict) -> str | None:
    """The tokenizer sha256 a checkpoint manifest's data source names (None: not a BPE run)."""
    source = (manifest.get("data") or {}).get("source") or {}
    return source.get("tokenizer_sha256") if isinstance(source, dict) else None


def tokenizer_for_checkpoint(checkpoint: str | Path, manifest: dict | None) -> BpeTokenizer | None:
    """The BPE tokenizer a checkpoint was trained with: its own copy, ``<checkpoint>/tokenizer/``
    (a file the manifest lists and ``checkpoint.verify`` hashes), whose sha256 must be the one the
    data source records; None for a run without one (byte-level or synthetic). A consolidated
    .safetensors file (``manifest`` None) uses the ``tokenizer/`` directory beside it, where
    ``scripts/ckpt.py consolidate`` puts the checkpoint's copy, when there is one."""
    path = Path(checkpoint)
    if manifest is None:
        beside = path.parent / "tokenizer"
        return load_tokenizer(beside) if (beside / TOKENIZER_JSON).is_file() else None
    expected = recorded_sha256(manifest)
    if expected is None:
        return None
    own = path / "tokenizer"
    if not (own / TOKENIZER_JSON).is_file():
        raise DataError(
            f"checkpoint {path} was trained with the BPE tokenizer of sha256 {expected} but holds no "
            f"copy of it ({own / TOKENIZER_JSON})"
        )
    tokenizer = load_tokenizer(own)
    if tokenizer.sha256 != expected:
        raise DataError(
            f"checkpoint {path}: {own / TOKENIZER_JSON} has sha256 {tokenizer.sha256}, but the run was "
            f"trained with the tokenizer of sha256 {expected}"
        )
    return tokenizer
