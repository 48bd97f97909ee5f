"""The documents of a text source: each ``*.txt`` file is one document, each line of a ``*.jsonl``
file one (the string in its ``data.text_field``; blank lines are skipped), each row of a
``*.parquet`` file one (its ``data.text_field`` column; the optional ``parquet`` extra, pyarrow), in
the source's sorted file order (``text_source``: one file, or a directory's files recursively,
hidden ones skipped).

The held-out share (``data.val_fraction``) is whole documents from the end: the fewest last
documents that hold at least that fraction of the documents' UTF-8 bytes (none at 0), so no
document is split between training and validation.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from distlib.app.data.text_source import TextSource, read_bytes, read_file
from distlib.app.data.tokens import DataError

RECORDS = (".jsonl", ".parquet")  # files of several documents, each a record
SUFFIXES = (".txt", *RECORDS)
_ROOT = str(Path(__file__).resolve().parents[3])  # the repository root: where the child imports distlib


def _lines(path: Path, sha: str) -> Iterator[str]:
    """The lines of a jsonl file, read as they are needed (memory: one line), and a DataError at
    the end if the bytes read are not the ones ``scan`` hashed."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for raw in f:
            digest.update(raw)
            yield raw.decode("utf-8")
    if digest.hexdigest() != sha:
        raise DataError(f"data.path {path} changed while it was being tokenized; run again")


def _jsonl(lines: Iterator[str], where: str, field: str) -> Iterator[str]:
    """Each record's ``field``. Lines end at "\n" only, as JSON Lines says (a U+2028 inside a
    string is text, not a line break)."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise DataError(f"data.path {where} line {number} is not JSON: {exc}") from exc
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise DataError(
                f"data.path {where} line {number} has no string field {field!r} (data.text_field)"
            )
        yield record[field]


def _parquet(path: Path, sha: str, where: str, field: str) -> list[str]:
    """The column ``field`` of a parquet file, read in a child process: importing pyarrow starts
    threads (its allocator's and pools'), and this process must stay free of them (it may fork)."""
    proc = subprocess.run(
        [sys.executable, "-m", "distlib.app.data.parquet_column", field],
        input=read_bytes(path, sha),  # the bytes that were hashed, given to the child on stdin
        capture_output=True,
        env={**os.environ, "PYTHONPATH": _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines() or [
            f"exit status {proc.returncode}"
        ]
        raise DataError(f"data.path {where}: {lines[-1]}")
    return json.loads(proc.stdout)


def documents(source: TextSource, text_field: str) -> Iterator[str]:
    """Every document of ``source``, in order. DataError naming the file and line of a bad one."""
    for _, path, sha, _ in source.files:
        if path.name.endswith(".parquet"):
            yield from _parquet(path, sha, str(path), text_field)
        elif path.name.endswith(".jsonl"):
            yield from _jsonl(_lines(path, sha), str(path), text_field)
        else:
            yield read_file(path, sha)


def held_out_count(sizes: list[int], val_fraction: float) -> int:
    """How many of the last documents (their UTF-8 ``sizes``, in order) are held out."""
    want, held, count = int(sum(sizes) * val_fraction), 0, 0
    while held < want and count < len(sizes):
        count += 1
        held += sizes[-count]
    return count
