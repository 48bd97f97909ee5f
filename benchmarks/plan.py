"""The planner (scripts/plan.py) against the machine: its error per byte category on layouts it
trains, and how long planning takes.

    .venv/bin/python benchmarks/plan.py           # 24 layouts of 7 families, 6 steps each: ~5 min
    .venv/bin/python benchmarks/plan.py --quick   # 3 layouts: ~30 s

Errors: each layout trains 6 steps with train.py (``distlib/launch/plan_verify.py``, what
``scripts/plan.py --verify`` runs) and every rank's measured parameter, gradient, optimizer and
activation bytes (the end-of-run memory table) and its step peak (every tensor alive at once,
``metrics.step_peak``) are set against the prediction: the table gives, per layout, the largest
error of each over its ranks, in bytes (``bound``: zero.overlap at ZeRO-2/3, where the states'
prediction is the most the run can reach: the figure is how far under it the run stayed, and the
step peak is the dry step's, which the communication thread's timing can move; ``?``: activations
and step peak not predicted, models with experts). Speed: ``plan()`` over every
layout of seven searches (``SPEED_CASES``; --quick: llama at ``--speed-world`` ranks), bytes and step
times, each in a new interpreter, so nothing is cached; --speed-only: just these.

JSON: benchmarks/results/plan.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from distlib.app.config.run import RunConfig  # noqa: E402
from distlib.app.plan.report import plan, planned  # noqa: E402
from distlib.app.plan.timing import Machine  # noqa: E402
from distlib.launch import plan_verify  # noqa: E402
from distlib.launch.hydra_config import compose_tree  # noqa: E402

LAYOUTS = [  # world size 4 unless said; (the families, five dimensions, ZeRO 0-3, bf16, overlap)
    "zero=stage0",
    "zero=stage1 train.dtype=bf16",
    "zero=stage2 zero.bucket_numel=2000",
    "zero=stage3 model.activation_checkpointing=blocks",
    "model=gpt2 dist.tp=2 dist.sp=true zero=stage2",
    "model=gpt2 dist.pp=2 train.grad_accum=2 zero=stage1",
    "model=gpt2 dist.cp=2 dist.cp_impl=ring zero=stage3 train.dtype=bf16",
    "model=gpt2 zero=stage3 zero.overlap=true",
    "model=llama dist.tp=2 zero=stage3",
    "model=llama dist.tp=4 zero=stage2 train.dtype=bf16",
    "model=llama dist.cp=2 dist.tp=2 zero=stage1",
    "model=llama dist.pp=2 dist.tp=2 train.grad_accum=2 zero=stage2",
    "model=llama model.n_layers=4 dist.pp=2 dist.pp_schedule=interleaved dist.pp_virtual=2"
    " train.grad_accum=4",
    "model=llama dist.pp=4 model.n_layers=4 train.grad_accum=4 dist.pp_schedule=gpipe",
    "model=llama zero=stage2 zero.overlap=true",
    "model=qwen3_tiny dist.tp=2 zero=stage2",
    "model=mixtral_tiny dist.ep=4 zero=stage2",
    "model=mixtral_tiny dist.ep=2 zero=stage3",
    "model=mixtral_tiny dist.ep=2 dist.tp=2 dist.sp=true",
    "model=mixtral_tiny dist.ep=2 dist.pp=2 train.grad_accum=2",
    "model=deepseek_v3_tiny dist.ep=2 zero=stage2",
    "model=qwen3_moe dist.ep=4 zero=stage3 train.dtype=bf16",
    "model=gpt2 dist.world_size=2 zero=stage3 train.dtype=bf16",
    "model=llama dist.world_size=1 zero=stage0",
]
QUICK = [LAYOUTS[2], LAYOUTS[9], LAYOUTS[16]]
CATEGORIES = ("params", "grads", "optimizer", "activations")


def errors(hydra: list[str]) -> dict:
    """One layout trained and compared: per category the largest |measured - planned| over ranks."""
    words = hydra if any(w.startswith("dist.world_size=") for w in hydra) else [*hydra, "dist.world_size=4"]
    layout = planned(RunConfig.from_dict(compose_tree(words)), [])
    (result,) = plan_verify.verify(words, [layout])
    row = {"layout": " ".join(hydra), "misses": result["misses"], "exact": layout.exact}
    for c in CATEGORIES:
        if c == "activations" and not layout.activations_known:
            row[c] = None
            continue
        planned_of = [
            a if c == "activations" else getattr(r, c) for r, a in zip(layout.ranks, layout.activations)
        ]
        row[c] = max(abs(m[c] - p) for m, p in zip(result["ranks"], planned_of))
    peaks = result["planned_step_peaks"]
    if peaks is None or None in peaks:
        row["step_peak"] = row["step_peak_pct"] = None
    else:
        misses = [abs(m["step_peak"] - p) for m, p in zip(result["ranks"], peaks)]
        row["step_peak"] = max(misses)
        row["step_peak_pct"] = max(100 * e / p for e, p in zip(misses, peaks))
    return row


# the planning-time searches: the tiny presets' ~1,000 layouts, deeper and wider worlds, and an 8B
# Llama's shape (32 blocks of 4,096, 32 heads over 8 KV heads, 4,096 tokens, 64 sequences a step)
SPEED_CASES = [
    "model=llama dist.world_size=4",
    "model=llama dist.world_size=8",
    "model=llama dist.world_size=16 model.n_layers=16",
    "model=llama dist.world_size=8 model.n_layers=32 model.dim=4096 model.n_heads=32 model.n_kv_heads=8"
    " model.seq_len=4096 model.vocab_size=32000 train.global_batch=64",
    "model=mixtral_tiny dist.world_size=4",
    "model=qwen3_moe dist.world_size=4",
    "model=deepseek_v3_tiny dist.world_size=4",
]


def speed(words: str) -> dict:
    """Planning every layout of ``words`` in a new interpreter (nothing cached), bytes and step
    times: ``plan()``'s time, the machine probed first and outside it."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--speed-case", words],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout)


def speed_case(words: str) -> dict:
    tree = compose_tree(words.split())
    machine = Machine.probe()
    t0 = time.perf_counter()
    layouts, refused = plan(tree, set(), machine)
    t1 = time.perf_counter()
    return {"search": words, "layouts": len(layouts), "refused": len(refused), "seconds": t1 - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--speed-only", action="store_true", help="only the planning times")
    parser.add_argument("--speed-world", type=int, default=2, help="--quick: the one search's world size")
    parser.add_argument("--speed-case", help=argparse.SUPPRESS)  # one search, in its own interpreter
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "plan.json"))
    args = parser.parse_args()
    if args.speed_case:
        print(json.dumps(speed_case(args.speed_case)))
        return
    rows = (
        [] if args.speed_only else [errors(layout.split()) for layout in (QUICK if args.quick else LAYOUTS)]
    )
    if rows:
        print_errors(rows)
    cases = [f"model=llama dist.world_size={args.speed_world}"] if args.quick else SPEED_CASES
    searches = [speed(words) for words in cases]
    head = f"{'layouts':>8} {'refused':>8} {'seconds':>8} {'ms each':>8}"
    print(f"{head}  search (plan(), cold, in a new process)")
    for c in searches:
        each = 1e3 * c["seconds"] / max(c["layouts"], 1)
        print(f"{c['layouts']:>8} {c['refused']:>8} {c['seconds']:>8.2f} {each:>8.2f}  {c['search']}")
    if args.speed_only:  # the error rows an earlier run wrote stay
        rows = _earlier_rows(args.out)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "speed": searches}, f, indent=1)


def _earlier_rows(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return json.load(f).get("rows", [])
    except (OSError, ValueError):
        return []


def print_errors(rows: list[dict]) -> None:
    head = " ".join(f"{c:>8}" for c in ("params", "grads", "optim", "activ", "step pk"))
    print(f"{head}  layout (the largest |measured - planned| bytes over its ranks)")
    for r in rows:
        cells = ["?" if r[c] is None else str(r[c]) for c in (*CATEGORIES, "step_peak")]
        bound = "" if r["exact"] else " (bound)"
        print(
            " ".join(f"{c:>8}" for c in cells)
            + f"  {r['layout']}{bound}{'  MISS: ' + '; '.join(r['misses']) if r['misses'] else ''}"
        )


if __name__ == "__main__":
    main()
