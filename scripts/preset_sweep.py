"""Every model preset trains long at its own defaults without a guard trip (docs/models.md, Presets).

    .venv/bin/python scripts/preset_sweep.py [--steps 1000] [--presets NAME ...] [--max-params N]
                                             [--set KEY=VALUE ...] [--out PATH]

Each preset of conf/model/ but the capstone's ``minigpt`` (its 20 steps are a contract) runs as a
user would start it, one after another: ``train.py model=NAME dist.world_size=1 train.steps=STEPS``
with everything else at its defaults (the guard on, the preset's own learning rate, warmup and
decay), only the progress lines and the periodic checkpoints off, in a temporary directory. Per
preset: its parameters, the guard's trips (the run's ``rollback`` events), how the run ended, the
steps logged, the first, lowest and last loss, and the wall seconds. A preset over ``--max-params``
(default 10M: gpt2_124m and llama_small, a GPU's work: their 1,000 steps take hours on 2 cores) is
left out unless named, and the table says so. ``--set`` adds overrides to every run (a device, a
world size). The exit status is 1 when a run tripped the guard or failed.

A table on stdout; JSON at --out (default outputs/preset_sweep.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from distlib.app.config.run import RunConfig  # noqa: E402
from distlib.app.model import families  # noqa: E402
from distlib.launch.hydra_config import compose_tree  # noqa: E402

CONTRACT = "minigpt"  # the capstone's model: its 20 steps at the default settings are the contract
QUIET = ["metrics.progress_every=0", "checkpoint.every_steps=0"]


def presets() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml") if p.stem != CONTRACT)


def param_count(name: str) -> int:
    return families.param_count(RunConfig.from_dict(compose_tree([f"model={name}"])).model)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run(name: str, steps: int, extra: list[str], root: Path) -> dict:
    """One preset's run and what its metrics file says."""
    run_dir = root / name
    cmd = [sys.executable, "train.py", f"model={name}", "dist.world_size=1", f"train.steps={steps}"]
    cmd += [*QUIET, *extra, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    records = _records(run_dir)
    losses = [r["loss"] for r in records if r["type"] == "step"]
    ends = [r for r in records if r["type"] == "event" and r.get("event") == "run_end"]
    row = {
        "preset": name,
        "exit": proc.returncode,
        "trips": sum(r["type"] == "event" and r.get("event") == "rollback" for r in records),
        "status": ends[-1].get("status") if ends else None,
        "steps": len(losses),
        "first": losses[0] if losses else None,
        "lowest": min(losses) if losses else None,
        "last": losses[-1] if losses else None,
        "seconds": seconds,
    }
    if proc.returncode:  # the run's own line first (the launcher's own follows it)
        said = [line for line in proc.stderr.splitlines() if line.startswith("error")] or ["(no error line)"]
        row["error"] = said[0]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--presets", nargs="+", help="these presets only (any size); default: every one")
    ap.add_argument("--max-params", type=float, default=10e6, help="larger presets run only when named")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every run")
    ap.add_argument("--out", default="outputs/preset_sweep.json")
    args = ap.parse_args()
    unknown = sorted(set(args.presets or []) - set(presets()))
    if unknown:
        sys.exit(f"--presets: no preset {unknown} in conf/model/ (there are {', '.join(presets())})")
    params = {name: param_count(name) for name in args.presets or presets()}
    chosen = [n for n, p in params.items() if args.presets or p <= args.max_params]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            rows.append(run(name, args.steps, args.set, Path(tmp)) | {"params": params[name]})
            print(_line(rows[-1]), flush=True)
    left_out = {n: p for n, p in params.items() if n not in chosen}
    for name, count in left_out.items():
        print(
            f"{name:<18}{count:>12,}  left out: over --max-params {args.max_params:,.0f} (name it to run it)"
        )
    result = {"steps": args.steps, "overrides": args.set, "runs": rows, "left_out": left_out}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    bad = [r["preset"] for r in rows if r["trips"] or r["exit"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} presets trained {args.steps} steps without a guard trip")
    return 1 if bad else 0


def _line(r: dict) -> str:
    losses = "  ".join(f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("first", "lowest", "last"))
    what = f"exit {r['exit']}: {r.get('error', r['status'])}" if r["exit"] else r["status"]
    return (
        f"{r['preset']:<18}{r['params']:>12,}  trips {r['trips']}  steps {r['steps']:>5}  "
        f"loss {losses}  {r['seconds']:6.1f} s  {what}"
    )


if __name__ == "__main__":
    sys.exit(main())
