"""The documents of a text source: each ``*.txt`` file is one document, each line of a ``*.jsonl``
file one (the string in its ``data.text_field``; blank lines are skipped), in the source's sorted
file order (``text_source``: one file, or a directory's files recursively, hidden ones skipped).

The held-out share (``data.val_fraction``) is whole documents from the end: the fewest last
documents that hold at least that fraction of the documents' UTF-8 bytes (none at 0), so no
document is split between training and validation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from distlib.app.data.text_source import TextSource, read_file
from distlib.app.data.tokens import DataError

SUFFIXES = (".txt", ".jsonl")


def _jsonl(text: str, where: str, field: str) -> Iterator[str]:
    for number, line in enumerate(text.splitlines(), 1):
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


def documents(source: TextSource, text_field: str) -> Iterator[str]:
    """Every document of ``source``, in order. DataError naming the file and line of a bad one."""
    for _, path, sha, _ in source.files:
        text = read_file(path, sha)
        if path.name.endswith(".jsonl"):
            yield from _jsonl(text, str(path), text_field)
        else:
            yield text


def held_out_count(sizes: list[int], val_fraction: float) -> int:
    """How many of the last documents (their UTF-8 ``sizes``, in order) are held out."""
    want, held, count = int(sum(sizes) * val_fraction), 0, 0
    while held < want and count < len(sizes):
        count += 1
        held += sizes[-count]
    return count
