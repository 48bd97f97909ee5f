"""``python -m distlib.app.data.parquet_column FIELD < FILE``: the column FIELD of the parquet file on
stdin as one JSON list of strings on stdout, or one line on stderr and exit status 1 (no pyarrow,
not a parquet file, no such column, a row that is not a string). ``documents`` runs it as a child process, so
that pyarrow's threads never live in a training process."""

from __future__ import annotations

import json
import sys

MISSING_EXTRA = "needs the optional `parquet` extra (pip install pyarrow==26.0.1), which is not installed"


def column(raw: bytes, field: str) -> list[str]:
    """The strings of column ``field`` of the parquet file ``raw``; ValueError naming what is wrong."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ValueError(f"a parquet file {MISSING_EXTRA}") from exc
    try:
        table = pyarrow.parquet.read_table(pyarrow.BufferReader(raw), use_threads=False)
    except pyarrow.ArrowException as exc:
        raise ValueError(f"not a parquet file: {exc}") from exc
    if field not in table.column_names:
        raise ValueError(f"no column {field!r} (data.text_field): it has {table.column_names}")
    values = table.column(field).to_pylist()
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise ValueError(f"row {row} of column {field!r} is not a string: {value!r}")
    return values


def main(argv: list[str]) -> int:
    try:
        print(json.dumps(column(sys.stdin.buffer.read(), argv[0])))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
