"""Synchronous rounds and collectives per training step of the capstone configuration, and its
step wall time with the collectives' header check on and off.

    .venv/bin/python benchmarks/rounds.py            # 4 ranks, 8 steps, 3 interleaved rounds
    .venv/bin/python benchmarks/rounds.py --quick    # 1 round

Each variant trains the capstone (conf/ defaults: 4 ranks, ZeRO stage 1) on forked gloo ranks
(tests/multiproc.run_ranks) with checkpoints off, so every step runs the same collectives. Per
step (steps 2..end, rank 0) it counts:
  * collectives: outermost calls, summed over the world's, the data- and tensor-parallel groups'
    CommStats (distlib/comm/group.py);
  * waits: ``P2P.wait`` calls that find a message still in flight -- a rank sleeping until its
    peers' messages arrive -- and barriers of the shared-memory board (distlib/comm/board.py),
    which the collectives of a group on one host use: the synchronous rounds (the header check had
    one of its own per collective; now it rides in the payload's messages, or the board's barrier);
and times the step (median over steps of the slowest rank). Variants check_collectives true and
false run interleaved (round r: true, false, ...) so outside load hits both alike; the header's
price is ratio = checked / unchecked step time. The baseline is torch's own ("torch" row): the
same steps with no header check at all are the floor any check is measured against.
JSON: benchmarks/results/rounds.json.
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

from multiproc import run_ranks
from trainrun import compose_tree

from distlib.app.config.run import RunConfig
from distlib.app.runtime.hooks import StepHooks
from distlib.app.trainer import Trainer
from distlib.comm import board, p2p

NPROC = 4


class StepCounter(StepHooks):
    """Collectives, waits and seconds of each step (set ``trainer`` after building it)."""

    def __init__(self):
        self.trainer, self.rows, self._at = None, [], None

    def _now(self):
        t = self.trainer
        stats = {id(c.stats): c.stats for c in (t.comm, t.mesh.dp, t.mesh.tp) if c.stats is not None}
        return sum(s.total_calls for s in stats.values()), WAITS[0], time.perf_counter()

    def before_step(self, step: int) -> None:
        self._at = self._now()

    def after_step(self, step: int) -> None:
        now = self._now()
        self.rows.append([step] + [b - a for a, b in zip(self._at, now)])


WAITS = [0]


def _pending(m) -> bool:
    work = getattr(m, "work", None)
    return work is None or (hasattr(work, "is_completed") and not work.is_completed())


def _counting_wait(wait):
    """Count the outermost P2P.wait calls that find a message still in flight: the times a rank
    sleeps until its peers catch up (a wait nested in another -- the header gate's -- is part of it)."""
    depth = [0]

    def counted(self, *handles):
        gate = getattr(p2p, "GATE", None)
        unchecked = gate is not None and gate.get() is not None and not gate.get().settled
        if depth[0] == 0 and (unchecked or any(_pending(m) for m in handles if m is not None)):
            WAITS[0] += 1
        depth[0] += 1
        try:
            return wait(self, *handles)
        finally:
            depth[0] -= 1

    return counted


def _counting_barrier(barrier):
    def counted(self, s):
        WAITS[0] += 1
        return barrier(self, s)

    return counted


def per_step(comm, tree: dict, run_dir: str) -> list[list[float]]:
    """One rank of a run; per step: [step, collectives, waits, seconds]."""
    p2p.P2P.wait = _counting_wait(p2p.P2P.wait)  # (a forked rank: patched for this run only)
    board.Board.barrier = _counting_barrier(board.Board.barrier)
    hooks = StepCounter()
    trainer = Trainer(RunConfig.from_dict(tree), comm, Path(run_dir), hooks=hooks)
    hooks.trainer = trainer
    trainer.run()
    return hooks.rows


def capstone_tree(check: bool, steps: int) -> dict:
    return compose_tree(
        [
            f"train.steps={steps}",
            "checkpoint.every_steps=0",
            "checkpoint.every_minutes=0",
            "metrics.progress_every=0",
            f"dist.check_collectives={str(check).lower()}",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    variants = {"checked": True, "unchecked": False}
    results = {name: {"collectives": set(), "waits": set(), "seconds": []} for name in variants}
    for _ in range(1 if args.quick else 3):
        for name, check in variants.items():
            with tempfile.TemporaryDirectory() as d:
                ranks = run_ranks(per_step, NPROC, capstone_tree(check, args.steps), d)
            for s in range(1, args.steps):  # step 1 warms up
                r = results[name]
                r["collectives"].add(ranks[0][s][1])
                r["waits"].add(ranks[0][s][2])
                r["seconds"].append(max(rows[s][3] for rows in ranks))
    table = {
        name: {
            "collectives_per_step": sorted(r["collectives"]),
            "waits_per_step": sorted(r["waits"]),
            "step_ms_median": 1000 * statistics.median(r["seconds"]),
            "step_ms_min": 1000 * min(r["seconds"]),
            "step_ms_max": 1000 * max(r["seconds"]),
        }
        for name, r in results.items()
    }
    ratio = table["checked"]["step_ms_median"] / table["unchecked"]["step_ms_median"]
    print(f"capstone config, {NPROC} ranks, {args.steps} steps, rank 0's counts per step")
    print(f"{'variant':<10} {'collectives':>11} {'waits':>7} {'step ms (median, min-max)':>28}")
    for name, row in table.items():
        print(
            f"{name:<10} {','.join(map(str, row['collectives_per_step'])):>11} "
            f"{','.join(map(str, row['waits_per_step'])):>7} {row['step_ms_median']:>12.1f} "
            f"({row['step_ms_min']:.1f}-{row['step_ms_max']:.1f})"
        )
    print(f"header check: checked / unchecked step time = {ratio:.3f}")
    out = Path(ROOT) / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "rounds.json").write_text(
        json.dumps(
            {"nproc": NPROC, "steps": args.steps, "variants": table, "checked_over_unchecked": ratio},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
