"""A metrics file as the run appends to it and reads it back: one JSON record a line, and a line a
kill cut short kept apart from the records after it."""

from __future__ import annotations

import json
from pathlib import Path


def appending(path: Path):
    """``path`` opened to append records, on a line of their own: a line a kill cut short stays
    alone (and is skipped by readers that skip what does not parse) instead of joining the next."""
    torn = path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
    f = open(path, "a")
    if torn:
        f.write("\n")
    return f


def last_step(path: Path) -> int | None:
    """The step of a metrics file's last step record (a line cut short by a kill is skipped)."""
    last = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("type") == "step":
            last = record["step"]
    return last
