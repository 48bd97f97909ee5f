"""Draw a pipeline step's timeline from recorded events: one row per pipeline rank, one box per
forward (blue) or backward (orange) from its measured start to its end, the micro-batch number
in the box (``3.1``: micro-batch 3, chunk 1; later chunks in darker shades), idle time blank.
An action shorter than 0.5% of the step is drawn 0.5% wide, so that every action shows.

    python scripts/pipeline_timeline.py benchmarks/results/pipeline.json --out-dir docs/img

The input is benchmarks/pipeline.py's JSON (or any JSON with ``runs``: a list of objects with
``schedule``, ``pp``, ``m``, ``v`` and ``events``, the events of ``recorder.Recorder`` from every
rank). One PNG per run: ``pipeline_<schedule>_pp<P>.png``. Needs matplotlib (requirements-dev.txt,
the same optional extra as scripts/report.py's charts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distlib.parallel.pipeline.recorder import bubble, theory

FORWARD = ("#9ecae1", "#4292c6", "#08519c", "#08306b")  # chunk 0, 1, ... (blues)
BACKWARD = ("#fdae6b", "#f16913", "#a63603", "#7f2704")  # (oranges)


def draw(run: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events, P, v = run["events"], run["pp"], run.get("v", 1)
    t0 = min(e["t_start"] for e in events)
    span_ms = 1000 * (max(e["t_end"] for e in events) - t0)
    fig, ax = plt.subplots(figsize=(11, 0.6 * P + 1.4), dpi=100)
    for e in events:
        x, w = 1000 * (e["t_start"] - t0), max(1000 * (e["t_end"] - e["t_start"]), span_ms / 200)
        colors = FORWARD if e["kind"] == "F" else BACKWARD
        ax.barh(
            e["rank"],
            w,
            left=x,
            height=0.8,
            color=colors[e["chunk"] % len(colors)],
            edgecolor="black",
            linewidth=0.4,
        )
        label = f"{e['micro']}" + (f".{e['chunk']}" if v > 1 else "")
        if w > span_ms / 90:
            ax.text(
                x + w / 2,
                e["rank"],
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="white" if e["chunk"] else "black",
            )
    ax.set_yticks(range(P), [f"rank {r}" for r in range(P)])
    ax.invert_yaxis()
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("ms since the step's first action (measured)")
    measured = sum(bubble(events).values()) / P
    ax.set_title(
        f"{run['schedule']}{f' v={v}' if v > 1 else ''}, pp={P}, m={run['m']}: bubble {measured:.2f} "
        f"measured, {theory(run['schedule'], P, run['m'], v):.2f} theory",
        fontsize=10,
    )
    handles = [
        Patch(color=colors[c], label=f"{what}" + (f" chunk {c}" if v > 1 else ""))
        for what, colors in (("forward", FORWARD), ("backward", BACKWARD))
        for c in range(v)
    ]
    ax.legend(
        handles=handles,
        loc="upper center",
        fontsize=7,
        bbox_to_anchor=(0.5, -0.2 - 0.15 / P),
        ncol=2 * v,
        frameon=False,
    )
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("events", help="JSON with 'runs' (benchmarks/pipeline.py writes one)")
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--pp", type=int, default=None, help="draw only the runs of this pipeline degree")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "pipeline_timeline: matplotlib is not installed (pip install -r requirements-dev.txt)",
            file=sys.stderr,
        )
        return 2
    runs = json.loads(Path(args.events).read_text())["runs"]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for run in runs:
        if args.pp is not None and run["pp"] != args.pp:
            continue
        path = out / f"pipeline_{run['schedule']}_pp{run['pp']}.png"
        draw(run, path)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
