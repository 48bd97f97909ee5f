"""A metrics file as the run appends to it and reads it back: one JSON record a line, and a line a
kill cut short kept apart from the records after it."""

from __future__ import annotations

import json
from pathlib import Path


def appending(path: Path):
    """``path`` opened to append records, on a line of their own: a line a kill cut short stays
    alone (and is skipped by readers that skip what does not parse) instead of joining the next."""
    f = open(path, "a")
    if _ends_torn(path):
        f.write("\n")
    return f


def _ends_torn(path: Path) -> bool:
    """Whether ``path`` ends inside a line (its last byte, read alone, is not a newline)."""
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def step_records(path: Path) -> list[dict]:
    """A metrics file's step records in the order written (a line cut short by a kill is skipped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("type") == "step":
            out.append(record)
    return out


def last_step(path: Path) -> int | None:
    """The step of a metrics file's last step record."""
    steps = step_records(path)
    return steps[-1]["step"] if steps else None
