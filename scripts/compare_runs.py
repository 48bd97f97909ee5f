"""Compare two runs of the same job step by step and byte by byte.

    python scripts/compare_runs.py RUN_A RUN_B [--from-step K] [--checkpoint-step S]

Prints the two loss columns side by side, then checks that every loss from
step K on is bitwise equal (compared as float hex) and, with --checkpoint-step,
that both runs' step-S checkpoints hold byte-identical shards. Exits 0 only if
everything matches; otherwise names the first differing step or file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distlib.checkpoint import sharded as checkpoint


def read_losses(run_dir: Path) -> dict[int, str]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found")
    losses = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "loss_hex" in record and "step" in record:
            losses[record["step"]] = record["loss_hex"]  # a rolled-back step is overwritten by its redo
    return losses


def compare_checkpoints(a: Path, b: Path) -> list[str]:
    problems = []
    manifests = []
    for path in (a, b):
        try:
            manifests.append(checkpoint.verify(path))
        except checkpoint.CheckpointError as exc:
            return [str(exc)]
    files_a = {f["path"]: f for f in manifests[0]["files"]}
    files_b = {f["path"]: f for f in manifests[1]["files"]}
    if set(files_a) != set(files_b):
        return [f"checkpoint files differ: {sorted(files_a)} vs {sorted(files_b)}"]
    for name in sorted(files_a):
        if (a / name).read_bytes() != (b / name).read_bytes():
            problems.append(
                f"{name} differs (sha256 {files_a[name]['sha256'][:12]}... vs "
                f"{files_b[name]['sha256'][:12]}...)"
            )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--from-step", type=int, default=1, help="first step whose losses must match")
    parser.add_argument("--checkpoint-step", type=int, help="compare both runs' checkpoints of this step")
    args = parser.parse_args()

    a, b = read_losses(args.run_a), read_losses(args.run_b)
    steps = sorted(s for s in set(a) | set(b) if s >= args.from_step)
    if not steps:
        print(f"error: no steps >= {args.from_step} in either run", file=sys.stderr)
        return 1
    print(f"{'step':>4}  {'loss A':>22}  {'loss B':>22}  same")
    first_bad = None
    for step in steps:
        la, lb = a.get(step), b.get(step)
        same = la is not None and la == lb
        fa = float.fromhex(la) if la else float("nan")
        fb = float.fromhex(lb) if lb else float("nan")
        print(f"{step:>4}  {fa:>22.17g}  {fb:>22.17g}  {'yes' if same else 'NO'}")
        if not same and first_bad is None:
            first_bad = step
    if first_bad is not None:
        print(f"MISMATCH: losses first differ at step {first_bad}", file=sys.stderr)
        return 1
    if args.checkpoint_step is not None:
        name = checkpoint.step_dir_name(args.checkpoint_step)
        problems = compare_checkpoints(args.run_a / "checkpoints" / name, args.run_b / "checkpoints" / name)
        if problems:
            print(
                f"MISMATCH: step-{args.checkpoint_step} checkpoints differ: " + "; ".join(problems),
                file=sys.stderr,
            )
            return 1
        print(f"step-{args.checkpoint_step} checkpoints are byte-identical")
    print(f"RESUME EXACT: steps {steps[0]}-{steps[-1]} bitwise equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
