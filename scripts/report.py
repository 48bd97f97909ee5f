"""Turn a run's metrics.jsonl into a text summary and charts; compare the jobs of a sweep.

    python scripts/report.py RUN_DIR [--out DIR] [--no-png]

RUN_DIR is a run directory (it holds metrics.jsonl) or a Hydra multirun directory
(its job subdirectories hold them). Writes ``report.txt`` (also printed) and, when
matplotlib is installed (an optional extra: ``pip install matplotlib``), ``loss.png``
(the loss curve and the validation loss, rollbacks marked, abandoned steps shown in grey, a log
axis labelled as such) and ``memory.png``
(per-rank parameter / gradient / optimizer bytes and peak RSS); a mixture-of-experts run also
gets its tokens per expert (text, and ``experts.png``: scripts/report_experts.py); for a sweep, one
``loss.png`` with every job's curve, each in its own line style (a curve lying on another's is
named so in the legend), and a side-by-side table. A run traced with
``train.profile_steps`` (``traces/rank<R>.json``) also gets each rank's time split into
compute, communication and waiting (text, and ``time_split.png``). Needs no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling module, however it is loaded
import report_experts  # noqa: E402

METRICS = "metrics.jsonl"


def _num(x) -> float:
    """Metrics log NaN / inf as strings (JSON has neither)."""
    return float(x) if x is not None else math.nan


@dataclass
class Run:
    path: Path
    final: dict[int, dict] = field(default_factory=dict)  # step -> last record of that step
    abandoned: list[dict] = field(default_factory=list)  # step records later re-run after a rollback
    events: list[dict] = field(default_factory=list)

    @staticmethod
    def read(path: Path) -> Run:
        run = Run(path)
        lines = (path / METRICS).read_text().splitlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                if n == len(lines):  # a run killed mid-write leaves at most a torn last line
                    break
                raise SystemExit(f"error: {path / METRICS} line {n} is not JSON: {exc}") from None
            if record.get("type") == "event":
                run.events.append(record)
            elif "step" in record and "loss" in record:
                if record["step"] in run.final:
                    run.abandoned.append(run.final[record["step"]])
                run.final[record["step"]] = record
        return run

    def named(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]

    @property
    def steps(self) -> list[dict]:
        return [self.final[s] for s in sorted(self.final)]

    def world_size(self) -> int | None:
        for e in self.events:
            if "world_size" in e:
                return e["world_size"]
        memory = self.named("memory")
        return len(memory[-1]["per_rank"]) if memory else None

    def status(self) -> str:
        ends = self.named("run_end")
        errors = self.named("guard_stop") + self.named("desync") + self.named("error")
        if errors and (not ends or errors[-1]["time"] > ends[-1]["time"]):
            return f"failed at step {errors[-1]['step']} ({errors[-1]['event']})"
        if not ends:
            return "unfinished (no run_end event: still running, or killed)"
        return ends[-1]["status"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _validation(steps: list[dict]) -> list[str]:
    """The held-out loss (train.eval_every), the signal to watch on real text; none if never evaluated."""
    evaluated = [(s["step"], _num(s["val_loss"])) for s in steps if "val_loss" in s]
    if not evaluated:
        return []
    best = min(evaluated, key=lambda sv: sv[1])
    return [
        f"validation loss: first {evaluated[0][1]:.6f} (step {evaluated[0][0]}), last {evaluated[-1][1]:.6f} "
        f"(step {evaluated[-1][0]}), min {best[1]:.6f} (step {best[0]}); {len(evaluated)} evaluations"
    ]


def summary(run: Run) -> str:
    steps = run.steps
    lines = [f"run: {run.path}", f"status: {run.status()}"]
    if not steps:
        return "\n".join(lines + ["no step records"])
    losses = [_num(s["loss"]) for s in steps]
    times = [s["step_time_s"] for s in steps]
    lines += [
        f"steps logged: {len(steps)} (steps {steps[0]['step']}..{steps[-1]['step']}), world size "
        f"{run.world_size()}",
        f"loss: first {losses[0]:.6f}, last {losses[-1]:.6f}, min {min(losses):.6f}",
        *_validation(steps),
        *report_experts.text(steps),
        f"step time: median {1000 * statistics.median(times):.1f} ms, "
        f"mean {1000 * statistics.mean(times):.1f} ms; "
        f"tokens/s median {statistics.median(s['tokens_per_s'] or 0 for s in steps):.0f}",
    ]
    kinds: dict[str, list[float]] = {}
    for s in steps:
        for kind, entry in s.get("comm", {}).items():
            acc = kinds.setdefault(kind, [0, 0.0, 0.0])
            acc[0] += entry["calls"]
            acc[1] += entry["bytes"]["max"]
            acc[2] += entry["seconds"]["max"]
    if kinds:
        total = sum(s.get("step_time_s_max", s["step_time_s"]) for s in steps)
        lines.append("collectives inside the logged steps (per rank; max over ranks):")
        for kind, (calls, sent, secs) in sorted(kinds.items(), key=lambda kv: -kv[1][2]):
            lines.append(
                f"  {kind:<17} {calls:>7} calls  {_fmt_bytes(sent):>11} sent  {secs:8.3f} s "
                f"({100 * secs / total:.0f}% of the slowest rank's step time)"
            )
    memory = steps[-1].get("memory")
    if memory:
        lines.append(
            "memory at the last step (max / mean over ranks): "
            + ", ".join(
                f"{k.replace('_bytes', '')} {_fmt_bytes(v['max'])} / {_fmt_bytes(v['mean'])}"
                for k, v in memory.items()
            )
        )
    saved = run.named("checkpoint_saved")
    if saved:
        reasons = sorted({e["reason"] for e in saved})
        lines.append(
            f"checkpoints: {len(saved)} saved ({', '.join(reasons)}), last at step {saved[-1]['step']}"
        )
    for e in run.named("rollback"):
        lines.append(f"rollback at step {e['step']} -> step {e['to_step']}: {e['reason']}")
    for name in ("restart", "preempted", "desync", "guard_stop", "error"):
        for e in run.named(name):
            detail = e.get("message") or e.get("reason") or e.get("signal") or e.get("checkpoint") or ""
            lines.append(f"{name} at step {e['step']}" + (f": {detail}" if detail else ""))
    return "\n".join(lines)


STEP_RANGE, COLLECTIVE_RANGE = "step ", "collective:"  # names of distlib's profiler ranges


def time_split(run_dir: Path) -> list[dict] | None:
    """Per rank, the profiled steps' seconds split three ways, from the Chrome traces. The ranks
    run the same collectives in the same order; call i took d[r] on rank r, and the fastest rank's
    d is taken as the transfer itself (that rank arrived last and waited for nobody), so rank r
    spent min(d) communicating and d[r] - min(d) waiting for the others. Compute is the rest of the
    step ranges' time. None when the run has no traces."""
    files = sorted((run_dir / "traces").glob("rank*.json"), key=lambda f: int(f.stem[4:]))
    if not files:
        return None
    steps, calls = [], []
    for f in files:
        events = [e for e in json.loads(f.read_text())["traceEvents"] if e.get("ph") == "X"]
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith(STEP_RANGE)]
        steps.append(sum(b - a for a, b in spans) / 1e6)
        calls.append(
            [
                e["dur"] / 1e6
                for e in sorted(events, key=lambda e: e["ts"])
                if e["name"].startswith(COLLECTIVE_RANGE) and any(a <= e["ts"] <= b for a, b in spans)
            ]
        )
    matched = min(len(c) for c in calls)
    fastest = [min(c[i] for c in calls) for i in range(matched)]
    split = []
    for rank, (total, durations) in enumerate(zip(steps, calls)):
        comm = sum(fastest) + sum(durations[matched:])
        waiting = sum(durations[:matched]) - sum(fastest)
        split.append(
            {
                "rank": rank,
                "compute_s": total - comm - waiting,
                "comm_s": comm,
                "waiting_s": waiting,
                "collectives": len(durations),
            }
        )
    return split


def time_split_text(split: list[dict]) -> str:
    lines = [
        "time in the profiled steps (traces/, per rank): compute / communication / waiting for other ranks"
    ]
    for r in split:
        lines.append(
            f"  rank {r['rank']}: compute {1000 * r['compute_s']:8.1f} ms  communication "
            f"{1000 * r['comm_s']:8.1f} ms  waiting {1000 * r['waiting_s']:8.1f} ms  "
            f"({r['collectives']} collectives)"
        )
    return "\n".join(lines)


def time_split_png(split: list[dict], out: Path, plt) -> Path:
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * len(split)))
    ranks, left = [r["rank"] for r in split], [0.0] * len(split)
    for key, label in (("compute_s", "compute"), ("comm_s", "communication"), ("waiting_s", "waiting")):
        widths = [1000 * r[key] for r in split]
        ax.barh(ranks, widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(ranks)
    ax.set_ylabel("rank")
    ax.set_xlabel("ms in the profiled steps")
    ax.invert_yaxis()
    ax.legend(fontsize=8, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    path = out / "time_split.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare(runs: list[Run]) -> str:
    """One row per job, side by side."""
    header = (
        f"{'job':<28} {'ranks':>5} {'steps':>5} {'final loss':>11} {'min loss':>10} {'ms/step':>8} "
        f"{'tok/s':>8} {'optim B max':>12} {'peak RSS max':>13} {'rollbacks':>9}  status"
    )
    rows = [header]
    for run in runs:
        steps = run.steps
        if not steps:
            rows.append(f"{run.path.name:<28} {'-':>5} {0:>5}  (no steps)  {run.status()}")
            continue
        last = steps[-1]
        mem = last.get("memory", {})
        rows.append(
            f"{run.path.name:<28} {run.world_size() or '-':>5} {len(steps):>5} {_num(last['loss']):>11.6f} "
            f"{min(_num(s['loss']) for s in steps):>10.6f} "
            f"{1000 * statistics.median(s['step_time_s'] for s in steps):>8.1f} "
            f"{statistics.median(s['tokens_per_s'] or 0 for s in steps):>8.0f} "
            f"{_fmt_bytes(mem.get('optimizer_bytes', {}).get('max', 0)):>12} "
            f"{_fmt_bytes(mem.get('peak_rss_bytes', {}).get('max', 0)):>13} "
            f"{len(run.named('rollback')):>9}  {run.status()}"
        )
    return "\n".join(rows)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "x")]  # a job's line and marker, in turn


def _same_as(runs: list[Run], i: int) -> str | None:
    """The earlier job whose loss curve job ``i``'s lies on (equal to 1e-6), if one does."""
    mine = [_num(s["loss"]) for s in runs[i].steps]
    for other in runs[:i]:
        theirs = [_num(s["loss"]) for s in other.steps]
        if len(theirs) == len(mine) and all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(mine, theirs)):
            return other.path.name
    return None


def loss_figure(runs: list[Run], plt):
    """The loss curves (each job its own line style and marker, and a legend note where one lies on
    another's), the validation losses where a run evaluated, rollbacks marked; the y axis turns
    logarithmic, and says so, when a spike would flatten the curve."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, run in enumerate(runs):
        steps, (line, marker) = run.steps, STYLES[i % len(STYLES)]
        name = run.path.name if len(runs) > 1 else "loss"
        same = _same_as(runs, i)
        ax.plot(
            [s["step"] for s in steps],
            [_num(s["loss"]) for s in steps],
            linestyle=line,
            marker=marker,
            markersize=max(2.0, 5.0 - i),
            linewidth=max(0.8, 2.0 - 0.4 * i),
            label=f"{name} (on {same}'s curve)" if same else name,
        )
        evaluated = [s for s in steps if "val_loss" in s]
        if evaluated:
            ax.plot(
                [s["step"] for s in evaluated],
                [_num(s["val_loss"]) for s in evaluated],
                linestyle=line,
                marker="D",
                label=f"{name}: validation" if len(runs) > 1 else "validation loss",
            )
        if run.abandoned:
            ax.scatter(
                [s["step"] for s in run.abandoned],
                [_num(s["loss"]) for s in run.abandoned],
                marker="x",
                color="grey",
                label="abandoned (rolled back)" if len(runs) == 1 else None,
            )
        for e in run.named("rollback"):
            ax.axvline(e["step"], color="red", alpha=0.3, linestyle="--")
            if len(runs) == 1 and isinstance(e.get("loss"), (int, float)):
                ax.scatter(
                    [e["step"]], [e["loss"]], color="red", marker="^", label=f"guard trip at step {e['step']}"
                )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    shown = [y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y) and y > 0]
    if shown and max(shown) > 4 * min(shown):  # a spike would flatten the curve on a linear axis
        ax.set_yscale("log")
        ax.set_ylabel("loss (log scale)")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(plt.matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_major_locator(plt.matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title("loss" if len(runs) == 1 else f"loss: {len(runs)} jobs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def loss_png(runs: list[Run], out: Path, plt) -> Path:
    fig = loss_figure(runs, plt)
    path = out / "loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory_png(run: Run, out: Path, plt) -> Path | None:
    memory = run.named("memory")
    if not memory:
        return None
    rows = memory[-1]["per_rank"]
    ranks = [r["rank"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.27
    for i, key in enumerate(("params_bytes", "grads_bytes", "optimizer_bytes")):
        left.bar(
            [r + (i - 1) * width for r in ranks],
            [row[key] for row in rows],
            width,
            label=key.replace("_bytes", ""),
        )
    left.set_xticks(ranks)
    left.set_xlabel("rank")
    left.set_ylabel("bytes")
    left.set_title("tensors per rank")
    left.set_ylim(
        0, 1.3 * max(row[k] for row in rows for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))
    )
    left.legend(fontsize=8, ncol=3, loc="upper center")
    right.bar(ranks, [row["peak_rss_bytes"] / 2**20 for row in rows], color="tab:grey")
    right.set_xticks(ranks)
    right.set_xlabel("rank")
    right.set_ylabel("MiB")
    right.set_title("peak RSS per rank")
    fig.suptitle(f"memory at step {memory[-1]['step']}")
    fig.tight_layout()
    path = out / "memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory, or a Hydra multirun directory")
    parser.add_argument("--out", type=Path, help="where to write report.txt and the PNGs (default: RUN_DIR)")
    parser.add_argument("--no-png", action="store_true", help="only the text summary")
    args = parser.parse_args(argv)
    root: Path = args.run_dir
    if not root.is_dir():
        print(f"error: {root} is not a directory", file=sys.stderr)
        return 2
    if (root / METRICS).is_file():
        runs = [Run.read(root)]
    else:
        runs = [Run.read(d) for d in sorted(p for p in root.iterdir() if (p / METRICS).is_file())]
        if not runs:
            print(
                f"error: no {METRICS} in {root} or in its subdirectories "
                "(a run or a Hydra multirun directory)",
                file=sys.stderr,
            )
            return 2
    out = args.out or root
    out.mkdir(parents=True, exist_ok=True)
    split = time_split(root) if len(runs) == 1 else None
    if len(runs) == 1:
        text = summary(runs[0]) + (f"\n{time_split_text(split)}" if split else "")
    else:
        text = "\n\n".join([f"sweep: {root} ({len(runs)} jobs)", compare(runs)] + [summary(r) for r in runs])
    plt = None if args.no_png else _pyplot()
    if args.no_png:
        text += "\ncharts: not requested (--no-png)"
    elif plt is None:
        text += "\ncharts: PNGs skipped: matplotlib is not installed (optional: pip install matplotlib)"
    else:
        written = [loss_png(runs, out, plt)]
        if len(runs) == 1:
            written.append(memory_png(runs[0], out, plt))
            written.append(report_experts.png(runs[0].steps, out, plt))
            written.append(time_split_png(split, out, plt) if split else None)
        text += "\ncharts: " + ", ".join(str(p) for p in written if p)
    (out / "report.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
