"""``scripts/plan.py --verify K``: run some planned layouts on this machine, two steps each, and set
what every rank measured (the end-of-run memory table, ``report.json``) against the planner's
figures: the K smallest layouts and a seeded random sample of K of the others."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from distlib.app.plan.report import Planned

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"
# two steps (the peaks of every category are reached in the first; the second repeats it), quiet
SHORT = ["train.steps=2", "optimizer.warmup_steps=0", "checkpoint.every_steps=0"]
SHORT += ["checkpoint.verify_resume=false", "metrics.progress_every=0"]
CATEGORIES = ("params", "grads", "optimizer")


def chosen(planned: list[Planned], k: int, seed: int = 0) -> list[Planned]:
    """The first ``k`` of ``planned`` and a sample of ``k`` of the others (``seed``: the same each time)."""
    rest = planned[k:]
    return planned[:k] + random.Random(seed).sample(rest, min(k, len(rest)))


def verify(hydra: list[str], layouts: list[Planned]) -> list[dict]:
    """Per layout: its overrides, every rank's measured and planned bytes, and its misses (none:
    every category as planned: equal, or at most a bound; activations equal where planned)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="plan-verify-") as tmp:
        for i, layout in enumerate(layouts):
            measured = _measure(hydra + layout.overrides, Path(tmp) / str(i))
            if isinstance(measured, str):
                out.append({"overrides": layout.overrides, "misses": [measured]})
                continue
            out.append({"overrides": layout.overrides, "ranks": measured, "misses": misses(layout, measured)})
    return out


def _measure(overrides: list[str], run_dir: Path) -> list[dict] | str:
    """train.py's measured memory rows for ``overrides``, or the line it failed with."""
    cmd = [sys.executable, str(TRAIN_PY), *overrides, *SHORT, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=TRAIN_PY.parent)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        return f"train.py exited {done.returncode}: {lines[-1]}"
    return [row["measured"] for row in json.loads((run_dir / "report.json").read_text())["memory"]]


def misses(layout: Planned, measured: list[dict]) -> list[str]:
    """Where ``measured`` (rank order) is not what ``layout`` planned."""
    out = []
    for got, planned, kept in zip(measured, layout.ranks, layout.activations):
        for category in CATEGORIES:
            m, p = got[category], getattr(planned, category)
            if (m != p) if planned.exact else m > p:
                bound = "" if planned.exact else "at most "
                out.append(f"rank {planned.rank} {category}: measured {m}, planned {bound}{p}")
        if kept is not None and got["activations"] != kept:
            out.append(f"rank {planned.rank} activations: measured {got['activations']}, planned {kept}")
    return out
