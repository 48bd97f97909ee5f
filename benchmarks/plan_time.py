"""The planner's step time (scripts/plan.py, distlib/app/plan/timing.py) against the machine: how
well its prediction ranks the layouts a model can run in.

    .venv/bin/python benchmarks/plan_time.py           # 3 models, 15 layouts each: ~5 min
    .venv/bin/python benchmarks/plan_time.py --quick   # llama, 4 layouts: ~15 s

Per model, every layout at ``--world`` ranks is planned with its predicted step time on this
machine (``Machine.probe``: measured in this process first); the ``--best`` predicted fastest and
a seeded sample of ``--sample`` others train ``--steps`` steps each with train.py (what
``scripts/plan.py --verify`` runs; the measured step: the lower quartile of the step periods after
two warm-up steps). The table gives each measured against predicted, with the prediction's parts;
below it, the rank correlation of the two (Spearman) and how far the predicted fastest is from
the fastest measured. There is no torch counterpart: the measurement is the run's own step time.

JSON: benchmarks/results/plan_time.json (--out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from distlib.app.plan.report import plan  # noqa: E402
from distlib.app.plan.timing import Machine  # noqa: E402
from distlib.launch import plan_verify  # noqa: E402
from distlib.launch.hydra_config import compose_tree  # noqa: E402

# the presets (a few ms a step here: operators and collectives' latency dominate) and llama at
# benchmarks/step.py's medium shape (100-300 ms: its arithmetic counts)
MODELS = ["model=llama", "model=gpt2", "model=llama model.dim=256 model.seq_len=128 model.vocab_size=256"]


def measure(model: str, world: int, best: int, sample: int, seed: int, steps: int, machine: Machine) -> dict:
    """One model's layouts (``model``: its overrides): the predicted fastest ``best`` and
    ``sample`` others, trained."""
    hydra = [*model.split(), f"dist.world_size={world}"]
    layouts, _ = plan(compose_tree(hydra), set(), machine)
    ranked = sorted((p for p in layouts if p.time is not None), key=lambda p: p.time.total_s)
    picked = ranked[:best] + random.Random(seed).sample(ranked[best:], min(sample, len(ranked) - best))
    rows = []
    for layout, result in zip(picked, plan_verify.verify(hydra, picked, steps)):
        rows.append(
            {
                "layout": " ".join(layout.overrides) or "(as given)",
                "measured_ms": result.get("step_ms"),
                **layout.time.as_dict(),
                "misses": result["misses"],
            }
        )
    ran = [r for r in rows if r["measured_ms"] is not None]
    rho = plan_verify.spearman([r["step_ms"] for r in ran], [r["measured_ms"] for r in ran])
    if rows[0]["measured_ms"] is None:
        raise SystemExit(f"the predicted fastest layout did not run: {rows[0]['misses'][0]}")
    fastest = min(r["measured_ms"] for r in ran)
    return {
        "model": model,
        "world": world,
        "timed_layouts": len(ranked),
        "rows": rows,
        "rank_correlation": rho,
        "predicted_fastest": rows[0]["layout"],
        "predicted_fastest_over_measured_fastest": rows[0]["measured_ms"] / fastest,
    }


def report(result: dict) -> None:
    print(f"{result['model']} at {result['world']} ranks ({result['timed_layouts']} layouts timed):")
    print(f"{'measured':>9} {'predicted':>9} {'compute':>8} {'comm':>8} {'bubble':>8}  layout (ms a step)")
    for r in sorted(result["rows"], key=lambda r: r["measured_ms"] or float("inf")):
        measured = "failed" if r["measured_ms"] is None else f"{r['measured_ms']:.1f}"
        print(
            f"{measured:>9} {r['step_ms']:>9.1f} {r['compute_ms']:>8.1f} {r['comm_ms']:>8.1f} "
            f"{r['bubble_ms']:>8.1f}  {r['layout']}{_missed(r)}"
        )
    rho = result["rank_correlation"]
    print(
        f"rank correlation {'n/a' if rho is None else f'{rho:.2f}'}; the predicted fastest "
        f"({result['predicted_fastest']}) measured "
        f"{result['predicted_fastest_over_measured_fastest']:.2f}x the fastest measured"
    )


def _missed(row: dict) -> str:
    return "  MISS: " + "; ".join(row["misses"]) if row["misses"] else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="llama only, the fastest and 3 others")
    parser.add_argument("--models", nargs="+", default=MODELS, help="each a model's overrides")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--best", type=int, default=3, help="the predicted fastest layouts measured")
    parser.add_argument("--sample", type=int, default=12, help="other layouts measured, a seeded sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20, help="steps per layout (the first two not timed)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "plan_time.json"))
    args = parser.parse_args()
    if args.quick:
        args.models, args.best, args.sample, args.steps = MODELS[:1], 1, 3, 8
    machine = Machine.probe()
    print(
        f"this machine: {machine.flops / 1e9:.1f} GFLOP/s a process, "
        f"{1e6 * machine.op_s:.2f} us an operator, "
        f"{1e9 * machine.update_s:.2f} ns an AdamW element, {machine.cores} cores"
    )
    results = [
        measure(m, args.world, args.best, args.sample, args.seed, args.steps, machine) for m in args.models
    ]
    for result in results:
        report(result)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": dataclasses.asdict(machine), "models": results}, f, indent=1)


if __name__ == "__main__":
    main()
