"""A token cache in shards, written by every rank in parallel, the same bytes at any world size.

The tokens of a document source (``documents``) encoded one document at a time are one stream,
cut into shards of ``shard_tokens`` tokens (the last one shorter), raw little-endian ids
(``<u2`` while the vocabulary fits, else ``<u4``). A cache is a directory::

    index.json          what was encoded (source and tokenizer sha256, recipe, held-out documents),
                        the token count, where the held-out tokens start, and every shard's file,
                        token count and sha256
    shard_00000.bin     tokens [0, shard_tokens)
    shard_00001.bin     ...

Building (``build``, collective over the world): rank r encodes a contiguous block of the
documents (the r-th of ``world`` near-equal blocks, empty when there are more ranks than documents)
into a part file, streaming, so memory holds one document's ids and a bounded write buffer; the
ranks then exchange their token counts, and each writes the shards it is given (round robin),
copying the parts' pieces straight from their memory maps. The stream, and so every shard and index.json,
depends on the documents and the tokenizer only, never on the world size or the split. All of it
happens in a temporary directory beside the target, renamed into place by rank 0 once every shard
is written (a reader sees no cache or a whole one; a failed build leaves the old cache, if any).

Reading (``ShardedTokens``): memory maps of the shards as one sequence, sliced without copying
until a window is taken (``numpy.asarray``), which may span two shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distlib.app.data.tokens import DataError
from distlib.comm import agree
from distlib.comm.group import Comm

FORMAT = "distlib token shards"
VERSION = 1
INDEX = "index.json"
SHARD_TOKENS = 1 << 24  # 32 MiB of uint16 ids a file (copied from the parts' maps, not held)
BUFFER_TOKENS = 1 << 20  # a part file is written in pieces of this many ids
PROGRESS_EVERY_S = 5.0  # rank 0 says how far it is when encoding takes longer than this


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def block(count: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s documents [lo, hi) of ``count``: near-equal contiguous blocks in rank order."""
    return count * rank // world, count * (rank + 1) // world


class ShardedTokens:
    """Tokens [start, stop) of the stream the shards hold, as a read-only sequence: ``len``,
    slicing (a view), and ``numpy.asarray`` (a copy of just those tokens)."""

    def __init__(self, maps: list[np.ndarray], start: int = 0, stop: int | None = None):
        self.maps = maps
        self.ends = np.cumsum([len(m) for m in maps]).tolist()
        total = self.ends[-1] if self.ends else 0
        self.start, self.stop = start, total if stop is None else stop
        self.dtype = maps[0].dtype if maps else np.dtype("<u2")

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> ShardedTokens:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("sharded tokens take contiguous slices only")
        lo, hi, _ = key.indices(len(self))
        return ShardedTokens(self.maps, self.start + lo, self.start + max(lo, hi))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        pieces, begin = [], 0
        for m, end in zip(self.maps, self.ends):
            lo, hi = max(self.start, begin), min(self.stop, end)
            if lo < hi:
                pieces.append(np.asarray(m[lo - begin : hi - begin]))
            begin = end
        out = np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.dtype)
        return out.astype(dtype, copy=False) if dtype is not None else out

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()


@dataclass(frozen=True)
class Cache:
    path: Path
    index: dict

    @property
    def val_start(self) -> int:
        return self.index["val_start"]

    def tokens(self) -> ShardedTokens:
        """The shards as one sequence (memory maps); DataError if a shard is missing or short."""
        dtype, maps = np.dtype(self.index["dtype"]), []
        for shard in self.index["shards"]:
            path = self.path / shard["file"]
            want = shard["tokens"] * dtype.itemsize
            size = path.stat().st_size if path.is_file() else None
            if size != want:
                raise DataError(
                    f"token cache {self.path}: {shard['file']} has {size} bytes; index.json says {want}"
                )
            maps.append(np.memmap(path, dtype=dtype, mode="r") if want else np.zeros(0, dtype=dtype))
        return ShardedTokens(maps)


def open_cache(path: Path, key: dict) -> Cache | None:
    """The cache at ``path`` if its index says it holds what ``key`` names (and is whole), else None."""
    try:
        index = json.loads((Path(path) / INDEX).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        return None
    if index.get("key") != key:
        return None
    cache = Cache(Path(path), index)
    try:
        cache.tokens()
    except DataError:
        return None
    return cache


def open_built(path: Path, key: dict) -> Cache:
    """``open_cache`` of a cache rank 0 saw or built: DataError if this node does not see it so."""
    cache = open_cache(path, key)
    if cache is None:
        raise DataError(
            f"token cache {path} is missing or stale on this node after rank 0 saw or built it "
            f"(every node must see the data directory: a shared filesystem)"
        )
    return cache


@dataclass(frozen=True)
class Plan:
    """What every rank needs to build: the documents, the split, where to write."""

    target: Path
    tmp: Path
    documents: int
    held: int  # the last ``held`` documents are held out
    key: dict
    vocab_size: int


def build(
    plan: Plan,
    docs: Callable[[], Iterable[str]],
    encode: Callable[[str], list[int]],
    comm: Comm,
    say: Callable[[str], None] = print,
) -> Cache:
    """Encode ``docs()`` (every rank enumerates the same documents, encoding only its block) into
    the shards of ``plan.target`` (collective over ``comm``); every rank raises the same DataError
    if any rank fails."""
    try:
        return _build(plan, docs, encode, comm, say)
    except DataError:
        if comm.rank == 0:  # every rank raised the same error: nothing of the build is kept
            shutil.rmtree(plan.tmp, ignore_errors=True)
        raise


def _build(plan: Plan, docs, encode, comm: Comm, say) -> Cache:
    dtype = dtype_for(plan.vocab_size)
    parts = agree.agreed_all(lambda: _encode_part(plan, docs, encode, comm, dtype, say), comm, DataError)
    layout = _layout(parts)
    written = agree.agreed_all(lambda: _write_shards(plan, layout, comm, dtype), comm, DataError)
    shards = sorted((s for each in written for s in each), key=lambda s: s["file"])
    index = {
        "format": FORMAT,
        "version": VERSION,
        "key": plan.key,
        "dtype": dtype.str,
        "vocab_size": plan.vocab_size,
        "count": layout["count"],
        "val_start": layout["val_start"],
        "shard_tokens": SHARD_TOKENS,
        "shards": shards,
    }
    agree.agreed(lambda: _commit(plan, index), comm, DataError, rank0_only=True)
    return Cache(plan.target, index)


def _part(plan: Plan, rank: int) -> Path:
    return plan.tmp / f"part_{rank:05d}.bin"


def _encode_part(plan: Plan, docs, encode, comm: Comm, dtype: np.dtype, say) -> dict:
    """Rank ``comm.rank``'s block into its part file: {tokens, where its held-out tokens start}."""
    if not plan.tmp.is_dir():
        raise DataError(
            f"token cache: rank {comm.rank} cannot see {plan.tmp}, which rank 0 made for the build "
            f"(every node must see the data directory: a shared filesystem, or data.cache_dir on one)"
        )
    lo, hi = block(plan.documents, comm.size, comm.rank)
    val_doc = plan.documents - plan.held
    buffer, count, val_at = array("I"), 0, None  # 4 bytes an id: the write buffer stays small
    started = last = time.monotonic()
    with open(_part(plan, comm.rank), "wb") as out:
        for i, text in enumerate(docs()):
            if i >= hi:
                break
            if i < lo:
                continue
            if i == val_doc:
                val_at = count + len(buffer)
            buffer.extend(encode(text))
            if len(buffer) >= BUFFER_TOKENS:
                count += _flush(out, buffer, dtype, plan.vocab_size)
            now = time.monotonic()
            if comm.rank == 0 and now - last >= PROGRESS_EVERY_S:
                rate = (count + len(buffer)) / (now - started)
                say(f"tokenizing: rank 0 at document {i + 1 - lo} of its {hi - lo} ({rate:,.0f} tokens/s)")
                last = now
        count += _flush(out, buffer, dtype, plan.vocab_size)
    return {"tokens": count, "val_at": val_at}


def _flush(out, buffer: array, dtype: np.dtype, vocab: int) -> int:
    ids = np.frombuffer(buffer, dtype=np.uint32) if len(buffer) else np.zeros(0, dtype=np.uint32)
    if ids.size and ids.max() >= vocab:
        raise DataError(f"token ids must be in [0, {vocab}), got up to {ids.max()}")
    out.write(ids.astype(dtype).tobytes())
    count = int(ids.size)
    del ids  # (the view pins the buffer's memory until it goes)
    del buffer[:]
    return count


def _layout(parts: list[dict]) -> dict:
    """Where each part starts in the stream, its length, and where the held-out tokens start."""
    starts = np.cumsum([0] + [p["tokens"] for p in parts]).tolist()
    count = starts[-1]
    held_at = [starts[r] + p["val_at"] for r, p in enumerate(parts) if p["val_at"] is not None]
    return {"starts": starts, "count": count, "val_start": held_at[0] if held_at else count}


def _write_shards(plan: Plan, layout: dict, comm: Comm, dtype: np.dtype) -> list[dict]:
    """The shards this rank is given (k = rank, rank + world, ...), each from the parts' pieces."""
    count, starts, size = layout["count"], layout["starts"], SHARD_TOKENS
    n_shards = max(1, -(-count // size))
    done = []
    for k in range(comm.rank, n_shards, comm.size):
        lo, hi = k * size, min(count, (k + 1) * size)
        name, digest = f"shard_{k:05d}.bin", hashlib.sha256()
        with open(plan.tmp / name, "wb") as f:
            for r in range(len(starts) - 1):  # the parts' pieces, copied straight from their maps
                a, b = max(lo, starts[r]), min(hi, starts[r + 1])
                if a < b:
                    piece = np.memmap(_part(plan, r), dtype=dtype, mode="r")[a - starts[r] : b - starts[r]]
                    f.write(piece)
                    digest.update(piece)
                    del piece
            f.flush()
            os.fsync(f.fileno())
        done.append({"file": name, "tokens": hi - lo, "sha256": digest.hexdigest()})
    return done


def _commit(plan: Plan, index: dict) -> None:
    """Rank 0: the parts removed, index.json written, the directory renamed into place."""
    for part in plan.tmp.glob("part_*.bin"):
        part.unlink()
    with open(plan.tmp / INDEX, "w") as f:
        f.write(json.dumps(index, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    old = None
    if plan.target.exists():  # a stale cache: moved aside, then removed once the new one is in place
        old = plan.target.with_name(f".{plan.target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(plan.target, old)
    os.replace(plan.tmp, plan.target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def temporary_dir(target: Path) -> Path:
    """A fresh directory beside ``target`` for a build (rank 0 makes it; its name is shared)."""
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    return tmp
