"""The memory profile: each rank's measured peak bytes next to its formula, gathered to every rank.

``measured`` is the optimizer's accounting of the live tensors (parameters, gradients, optimizer
state; ``ZeroOptimizer.memory_bytes``) plus the activations kept for backward; ``formula`` maps
each term to (expected bytes, allowance above it, the formula as text). Each rank reports its own
formula: pipeline stages hold different parts of the model.
"""

from __future__ import annotations

from distlib.comm import agree
from distlib.comm.group import Comm


def memory_report(
    measured: dict[str, int], formula: dict[str, tuple[float, float, str]], comm: Comm
) -> list[dict]:
    """One row per rank: {rank, measured, expected, allowance, formula} (collective)."""
    keys, terms = sorted(measured), sorted(formula)
    rows = agree.gather(
        [float(measured[k]) for k in keys] + [formula[k][i] for i in (0, 1) for k in terms], comm
    )
    text, n = {k: v[2] for k, v in formula.items()}, len(keys)
    return [
        {
            "rank": r,
            "measured": dict(zip(keys, map(int, row[:n]))),
            "expected": dict(zip(terms, row[n:])),
            "allowance": dict(zip(terms, row[n + len(terms) :])),
            "formula": text,
        }
        for r, row in enumerate(rows)
    ]
