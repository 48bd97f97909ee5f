"""Fit distlib.comm.cost_model's constants to ``benchmarks/collectives.py --algos`` tables.

    .venv/bin/python benchmarks/fit_cost_model.py [benchmarks/cost_model_tables.txt ...]

A grid search over (alpha, mu, gamma, theta, nu, kappa) that minimises the total time of the
algorithms the model would choose, row by row, over the fastest measured, subject to the golden
contract: every all_reduce below 1 MiB at 2-8 ranks stays in rank order (exchange or direct).
Prints the best constants, the committed model's score and the rows where the choice is not the
fastest.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from distlib.comm import cost_model as M

GRID = {
    "alpha": (200e-6, 400e-6, 800e-6, 1.5e-3),
    "mu": (20e-6, 50e-6, 100e-6, 200e-6),
    "gamma": (0.3e-9, 1e-9, 2e-9),
    "theta": (0.15e-9, 0.3e-9, 0.6e-9),
    "nu": (0.0, 30e-6, 80e-6),
    "kappa": (0.0, 0.3e-9, 1e-9, 2e-9),
}


def parse(path: str) -> list[tuple[str, int, int, dict[str, float]]]:
    """(op, world, bytes, {algorithm: ms}) per row of every table in the file."""
    rows, names = [], []
    for line in open(path):
        if line.startswith("op "):
            names = re.findall(r"(\w+) ms", line)[2:]  # after "ours ms", "torch ms"
        elif line.startswith(tuple(M.CANDIDATES)) and names:
            f = line.split()
            size = int(f[2][:-1]) << (20 if f[2].endswith("M") else 10)
            rows.append((f[0], int(f[1]), size, {n: float(v) for n, v in zip(names, f[7:]) if v != "-"}))
    return rows


def score(rows, model: M.CostModel) -> float:
    """Chosen algorithms' total ms over the fastest's, as a fraction; inf if the contract breaks."""
    for world in range(2, 9):
        for k in range(2, 20):
            if M.choose_algorithm.__wrapped__("all_reduce", 1 << k, world, model) not in (
                "exchange",
                "direct",
            ):
                return float("inf")
    best = sum(min(ms.values()) for *_, ms in rows)
    return (
        sum(ms[M.choose_algorithm.__wrapped__(op, b, w, model)] - min(ms.values()) for op, w, b, ms in rows)
        / best
    )


def main() -> None:
    paths = sys.argv[1:] or [os.path.join(ROOT, "benchmarks", "cost_model_tables.txt")]
    rows = [r for p in paths for r in parse(p)]
    fits = sorted(
        (
            (score(rows, m), m)
            for m in (
                dataclasses.replace(M.MEASURED, **dict(zip(GRID, v)))
                for v in itertools.product(*GRID.values())
            )
        ),
        key=lambda f: f[0],
    )
    print(f"{len(rows)} rows; best: {fits[0][0]:.3f} over the fastest, {fits[0][1]}")
    print(f"committed: {score(rows, M.MEASURED):.3f} over the fastest, {M.MEASURED}")
    for op, w, b, ms in rows:
        got = M.choose_algorithm.__wrapped__(op, b, w, M.MEASURED)
        if ms[got] > min(ms.values()):
            print(
                f"  {op:15}{w:>3}{b:>10}  chose {got:13} {ms[got] / min(ms.values()):.2f}x the fastest, "
                f"{min(ms, key=ms.get)}"
            )


if __name__ == "__main__":
    main()
