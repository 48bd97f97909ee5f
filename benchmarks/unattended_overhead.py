"""What the unattended-run machinery costs per training step, measured in one run.

    .venv/bin/python benchmarks/unattended_overhead.py [--steps 40] [--rounds 3]

Trains the capstone model on 4 gloo ranks (in-process, forked) with:
  bare     guard off, desync check off, collective header check off
  guard    + divergence guard (its verdict replaces the loss all-reduce) and the
             replica hash check every 10 steps
  check    + the header exchange before every collective (dist.check_collectives)
Every variant always pays the per-step save/stop decision and the metrics gather.
The variants are run in rotating order, ``--rounds`` times, so background load on a
shared machine hits them alike; the table shows the median step time (steps 6+) and
the ratio to "bare". The second table times one small all_reduce (the guard's) with
and without the header exchange, next to torch's own gloo all_reduce.
JSON: benchmarks/results/unattended_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch
import torch.distributed as dist
from multiproc import run_ranks

from distlib.app.config.run import RunConfig
from distlib.app.trainer import Trainer
from distlib.comm import collectives

VARIANTS = {
    "bare": {"guard": {"enabled": False, "check_sync_every": 0}, "dist": {"check_collectives": False}},
    "guard": {"dist": {"check_collectives": False}},
    "check": {},
}


def _train(comm, tree, run_dir):
    result = Trainer(RunConfig.from_dict(tree), comm, Path(run_dir)).run()
    return [s.seconds for s in result.steps]


def _small_all_reduce(comm, iters):
    plain, checked = comm.instrumented(check=False), comm.instrumented(check=True)
    t = torch.zeros(2, dtype=torch.float64)
    fns = {
        "ours": lambda: collectives.all_reduce(t, plain),
        "ours + header check": lambda: collectives.all_reduce(t, checked),
        "torch gloo": lambda: dist.all_reduce(t),
    }
    times = {k: [] for k in fns}
    for i in range(iters):
        for name in list(fns)[i % 3 :] + list(fns)[: i % 3]:
            dist.barrier()
            began = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - began)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.steps < 6 or args.rounds < 1:
        parser.error("--steps must be >= 6 (steps 1-5 are warm-up, not timed) and --rounds >= 1")
    step_times = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            names = list(VARIANTS)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                tree = {
                    "train": {"steps": args.steps},
                    "metrics": {"progress_every": 0},
                    "checkpoint": {"every_steps": 0, "verify_resume": False},
                    **VARIANTS[name],
                }
                seconds = run_ranks(_train, 4, tree, f"{tmp}/{name}{r}")[0]
                step_times[name] += seconds[5:]
    medians = {name: statistics.median(v) for name, v in step_times.items()}
    print(f"capstone step on 4 ranks, median of {args.rounds} x {args.steps - 5} steps")
    print(f"{'variant':<8} {'ms/step':>8} {'vs bare':>8}")
    for name, m in medians.items():
        print(f"{name:<8} {1000 * m:>8.2f} {m / medians['bare']:>8.2f}")
    small = run_ranks(_small_all_reduce, 4, 200)[0]
    print("\none 16-byte all_reduce on 4 ranks (median of 200)")
    for name, s in small.items():
        print(f"{name:<22} {1e6 * s:>8.1f} us  {s / small['torch gloo']:>5.2f} x torch")
    out = Path(ROOT) / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "unattended_overhead.json").write_text(
        json.dumps(
            {
                "step_median_s": medians,
                "small_all_reduce_median_s": small,
                "steps": args.steps,
                "rounds": args.rounds,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
