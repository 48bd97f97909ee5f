"""Real text as tokens: a byte-level tokenizer and a memory-mapped token file.

The tokenizer is the file's own UTF-8 bytes (vocabulary 256, nothing to
download, every input representable). A source file is tokenized once into a
token file next to it (or in ``cache_dir``)::

    offset  size  field
         0     8  magic b"DLTOKENS"
         8     4  format version (1), little-endian uint32
        12     4  vocabulary size
        16     4  bytes per token: 1 (uint8, vocab <= 256) or 2 (uint16, vocab <= 65536)
        20     4  header size (64): where the tokens start
        24     8  token count, uint64
        32    32  sha256 of the source file's bytes
        64     .  the tokens

and read back with ``numpy.memmap``, so a rank touches only the windows it
trains on. The token file is reused while the source's sha256 matches the
header and rebuilt (atomically: temp file, then rename) when it does not.
Rank 0 alone builds it; the others wait for its verdict, then check the header
carries the same source hash (a node that cannot see the file says so).
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from distlib.app.config.data_group import BYTE_VOCAB
from distlib.comm import agree
from distlib.comm.group import Comm

T = TypeVar("T")

MAGIC = b"DLTOKENS"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIIIQ32s")
HEADER_BYTES = 64
_READ_BLOCK = 1 << 20


class DataError(ValueError):
    """A data source that cannot be trained on, naming the file and the reason."""


class ByteTokenizer:
    """Token i is byte value i of the UTF-8 encoding."""

    vocab_size = BYTE_VOCAB

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(tokens: list[int]) -> str:
        """Text of ``tokens``; a byte sequence cut mid-character shows as U+FFFD."""
        return bytes(tokens).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TokenFileHeader:
    vocab_size: int
    itemsize: int
    count: int
    source_sha256: str

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.itemsize == 1 else "<u2")


def _dtype_for(vocab_size: int) -> np.dtype:
    if 1 <= vocab_size <= 256:
        return np.dtype(np.uint8)
    if vocab_size <= 65536:
        return np.dtype("<u2")
    raise ValueError(f"vocabulary of {vocab_size} does not fit a uint16 token file")


def write_token_file(path: Path, tokens: np.ndarray, vocab_size: int, source_sha256: str) -> None:
    """Write ``tokens`` with a header, atomically (a reader never sees half a file)."""
    dtype = _dtype_for(vocab_size)
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    with atomic_file(Path(path)) as f:
        f.write(_header(vocab_size, tokens.size, source_sha256))
        f.write(tokens.astype(dtype, copy=False).tobytes())


def _header(vocab_size: int, count: int, source_sha256: str) -> bytes:
    dtype = _dtype_for(vocab_size)
    raw = HEADER.pack(
        MAGIC, FORMAT_VERSION, vocab_size, dtype.itemsize, HEADER_BYTES, count, bytes.fromhex(source_sha256)
    )
    return raw.ljust(HEADER_BYTES, b"\0")


@contextlib.contextmanager
def atomic_file(path: Path):
    """A file opened for writing that becomes ``path`` (synced, renamed) only if the block ends
    without an error; a failure leaves no trace."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _copy_byte_tokens(source: Path, target: Path, sha: str, count: int) -> None:
    """The byte-level token file of ``source``: its bytes behind a header, copied a block at a time
    (memory of one block, not of the text), checked against the sha256 the run hashed first."""
    digest = hashlib.sha256()
    with atomic_file(target) as out, open(source, "rb") as f:
        out.write(_header(BYTE_VOCAB, count, sha))
        for block in iter(lambda: f.read(_READ_BLOCK), b""):
            digest.update(block)
            out.write(block)
        if digest.hexdigest() != sha or out.tell() != HEADER_BYTES + count:
            raise DataError(f"data.path {source} changed while it was being tokenized; run again")


def read_start(path: Path, n: int) -> tuple[bytes, int]:
    """The first ``n`` bytes of a token file and its size; DataError naming it if it cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(n)
        return raw, path.stat().st_size
    except OSError as exc:
        raise DataError(f"token file {path}: {exc.strerror or exc}") from exc


def read_header(path: Path) -> TokenFileHeader:
    """The header of a token file; DataError if it is not one or is truncated."""
    path = Path(path)
    raw, size = read_start(path, HEADER_BYTES)
    if len(raw) < HEADER.size:
        raise DataError(f"token file {path} is too short for a header ({len(raw)} bytes)")
    magic, version, vocab, itemsize, offset, count, sha = HEADER.unpack(raw[: HEADER.size])
    if magic != MAGIC or version != FORMAT_VERSION or offset != HEADER_BYTES or itemsize not in (1, 2):
        raise DataError(f"{path} is not a version-{FORMAT_VERSION} token file")
    if size != HEADER_BYTES + count * itemsize:
        raise DataError(
            f"token file {path} has {size} bytes; its header promises {HEADER_BYTES + count * itemsize}"
        )
    return TokenFileHeader(vocab, itemsize, count, sha.hex())


def open_tokens(path: Path) -> tuple[np.ndarray, TokenFileHeader]:
    """The tokens of a token file as a read-only memory map, and its header."""
    header = read_header(path)
    if header.count == 0:
        return np.zeros(0, dtype=header.dtype), header
    return np.memmap(path, dtype=header.dtype, mode="r", offset=HEADER_BYTES, shape=(header.count,)), header


def hash_utf8_file(path: Path) -> tuple[str, int]:
    """(sha256, byte count) of ``path``, checking on the way that it is UTF-8 text."""
    digest, decoder, count = hashlib.sha256(), codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_READ_BLOCK), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"data.path {path} is not UTF-8 text: {exc.reason} at byte {count + exc.start}"
                ) from exc
            digest.update(block)
            count += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise DataError(f"data.path {path} is not UTF-8 text: it ends inside a multi-byte character") from exc
    return digest.hexdigest(), count


def token_file_path(source: Path, cache_dir: str | None) -> Path:
    directory = Path(cache_dir) if cache_dir else source.parent
    return directory / f"{source.name}.u8.tokens"


def ensure_token_file(source: Path, cache_dir: str | None = None) -> tuple[Path, str, bool]:
    """Tokenize ``source`` unless an up-to-date token file exists.
    Returns (token file, source sha256, whether it was (re)built)."""
    source = Path(source)
    if not source.exists():
        raise DataError(
            f"data.path {source} does not exist (relative paths start at the launch directory {Path.cwd()})"
        )
    if not source.is_file():
        raise DataError(f"data.path {source} is not a regular file")
    sha, count = hash_utf8_file(source)
    if count == 0:
        raise DataError(f"data.path {source} is empty: there is nothing to train on")
    target = token_file_path(source, cache_dir)
    try:
        current = read_header(target)
        if (current.source_sha256, current.vocab_size, current.count) == (sha, BYTE_VOCAB, count):
            return target, sha, False
    except DataError:
        pass  # missing, foreign or damaged: rebuild it
    target.parent.mkdir(parents=True, exist_ok=True)
    _copy_byte_tokens(source, target, sha, count)
    return target, sha, True


def built_by_rank0(build: Callable[[], T], comm: Comm, failure: Callable[[Exception], str]) -> T:
    """``build``'s result, run on rank 0 only, on every rank; its DataError on every rank, and any
    other error as a DataError of ``failure(exc)``'s text (every rank must hear it, or the others
    wait forever)."""

    def guarded() -> T:
        try:
            return build()
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure, said on every rank
            raise DataError(failure(exc)) from exc

    return agree.agreed(guarded, comm, DataError, rank0_only=True)


def load_text_tokens(source: str, cache_dir: str | None, comm: Comm) -> tuple[np.ndarray, str]:
    """Every rank's view of ``source`` as byte tokens (memory-mapped) and the source sha256.
    Rank 0 (re)builds the token file; all ranks raise the same DataError if anything fails."""
    path = Path(source).expanduser()

    sha = built_by_rank0(
        lambda: ensure_token_file(path, cache_dir)[1],
        comm,
        lambda exc: (
            f"tokenizing data.path {path} into {token_file_path(path, cache_dir)} failed: "
            f"{type(exc).__name__}: {exc} (data.cache_dir names a writable directory for it)"
        ),
    )
    target = token_file_path(path, cache_dir)

    def open_built() -> tuple[np.ndarray, TokenFileHeader]:
        try:
            tokens, header = open_tokens(target)
        except DataError as exc:
            raise DataError(
                f"{exc} (every node must see the data directory rank 0 wrote: a shared filesystem)"
            ) from exc
        if header.source_sha256 != sha:
            raise DataError(
                f"token file {target} holds source sha256 {header.source_sha256}, rank 0 built "
                f"{sha}; every node must see the same data directory (a shared filesystem)"
            )
        return tokens, header

    tokens, _ = agree.agreed(open_built, comm, DataError)
    return tokens, sha
