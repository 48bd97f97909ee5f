"""``scripts/plan.py --verify K``: run some planned layouts on this machine, a few steps each, and
set what every rank measured (the end-of-run memory table, ``report.json``, with the step peak of
every tensor alive at once, ``metrics.step_peak``) against the planner's figures: the K smallest
layouts and a seeded random sample of K of the others. The step time measured (the lower quartile
of the periods between step records after the first two steps, which warm up and are metered) is
set beside the predicted one, and over the layouts the two rankings are compared (``spearman``)."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from distlib.app.observe import records
from distlib.app.plan import activations, step_peak
from distlib.app.plan.report import Planned, with_step_peaks

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"
# a few steps (the peaks of every category are reached in the first; the later ones repeat it, and
# from the third on a step's time no longer includes warming up), quiet
STEPS = 6
QUIET = ["optimizer.warmup_steps=0", "checkpoint.every_steps=0", "checkpoint.verify_resume=false"]
QUIET += ["metrics.progress_every=0", "metrics.step_peak=true"]  # (metered: the first two steps)
CATEGORIES = ("params", "grads", "optimizer")


def chosen(planned: list[Planned], k: int, seed: int = 0) -> list[Planned]:
    """The first ``k`` of ``planned`` and a sample of ``k`` of the others (``seed``: the same each time)."""
    rest = planned[k:]
    return planned[:k] + random.Random(seed).sample(rest, min(k, len(rest)))


def verify(hydra: list[str], layouts: list[Planned], steps: int = STEPS) -> list[dict]:
    """Per layout: its overrides, every rank's measured and planned bytes, its misses (none:
    every category as planned: equal, or at most a bound; activations equal where planned), and
    its measured and predicted step milliseconds (None where not predicted)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="plan-verify-") as tmp:
        for i, layout in enumerate(layouts):
            layout = with_step_peaks(layout)
            measured = _measure(hydra + layout.overrides, Path(tmp) / str(i), steps)
            if isinstance(measured, str):
                out.append({"overrides": layout.overrides, "misses": [measured]})
                continue
            ranks, step_ms = measured
            predicted = None if layout.time is None else 1e3 * layout.time.total_s
            out.append(
                {
                    "overrides": layout.overrides,
                    "ranks": ranks,
                    "misses": misses(layout, ranks),
                    "step_ms": step_ms,
                    "predicted_step_ms": predicted,
                    "planned_step_peaks": layout.step_peaks,
                }
            )
    return out


def _measure(overrides: list[str], run_dir: Path, steps: int = STEPS) -> tuple[list[dict], float] | str:
    """train.py's measured memory rows for ``overrides`` over ``steps`` steps and its step
    milliseconds: the lower quartile of the step periods after the first two steps (the machine's
    noise only ever adds to a step: measured, the same layout's median moved 10-20% between runs,
    its lower quartile less), or the line it failed with."""
    cmd = [
        sys.executable,
        str(TRAIN_PY),
        *overrides,
        f"train.steps={steps}",
        *QUIET,
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=TRAIN_PY.parent)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        return f"train.py exited {done.returncode}: {lines[-1]}"
    memory = [row["measured"] for row in json.loads((run_dir / "report.json").read_text())["memory"]]
    periods = step_periods(run_dir / "metrics.jsonl")[1:]  # (the first: the second step, warming up)
    return memory, 1e3 * (statistics.quantiles(periods, n=4)[0] if len(periods) > 1 else periods[0])


def step_periods(path: Path) -> list[float]:
    """The seconds from each step's record to the next one's in a metrics file: the step as the
    job runs it, every rank's part and the logging included (a rank's own ``step_time_s`` starts
    when that rank begins, and ranks that finished logging sooner begin sooner)."""
    times = {record["step"]: record["time"] for record in records.step_records(path)}
    ordered = [times[step] for step in sorted(times)]
    return [b - a for a, b in zip(ordered, ordered[1:])]


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """The rank correlation of two equally long series (ties share their mean rank); None for
    fewer than three pairs or a series without spread."""
    if len(xs) != len(ys) or len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    spread = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / spread if spread else None


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i : j + 1]:
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def misses(layout: Planned, measured: list[dict]) -> list[str]:
    """Where ``measured`` (rank order) is not what ``layout`` planned: equal, or at most a bound."""
    out = []
    for got, planned, kept in zip(measured, layout.ranks, layout.activations):
        for category in CATEGORIES:
            m, p = got[category], getattr(planned, category)
            if (m != p) if planned.exact else m > p:
                bound = "" if planned.exact else "at most "
                out.append(f"rank {planned.rank} {category}: measured {m}, planned {bound}{p}")
        if kept is not None and activations.missed(layout.cfg, got["activations"], kept):
            out.append(f"rank {planned.rank} activations: measured {got['activations']}, planned {kept}")
    return out + _step_peak_misses(layout, measured)


def _step_peak_misses(layout: Planned, measured: list[dict]) -> list[str]:
    """Every rank's step peak as predicted (``step_peak.missed``: to the byte, or at most a bound:
    with zero.overlap at stages 2/3, the communication thread's timing; with experts)."""
    out = []
    for rank, (got, want) in enumerate(zip(measured, layout.step_peaks or ())):
        m = got.get("step_peak")
        if want is not None and step_peak.missed(layout.cfg, m, want):
            out.append(f"rank {rank} step peak: measured {m}, planned {want}")
    return out
