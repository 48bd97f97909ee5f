"""Recovery from a SIGKILLed worker under torchrun: in-memory snapshots vs disk checkpoints only.

    .venv/bin/python benchmarks/recovery.py [--world-size 4] [--steps 24] [--kill-at 19] [--every 10]
                                            [--repeats 2]
                                            [--keep DIR]

Runs the capstone (`torchrun --nproc_per_node N --max-restarts 1 train.py`, resume=latest, disk
checkpoints every ``--every`` steps) and SIGKILLs rank 1 after step ``--kill-at`` (fault.kill_rank),
once with ``checkpoint.memory_every_steps=1`` ("snapshots") and once without ("disk only"), the two
interleaved ``--repeats`` times. From the run's metrics.jsonl (rank 0's wall clock):

  steps lost    the kill step minus the step the restart resumed after
  resumed s     from the kill to the restarted job's "restart" event (workers up, state restored)
  first step s  from the kill (the killed step's record) to the first step completed after restart
  caught up s   from the kill to the completion of step kill+1 (the first step not done before)

There is no torch counterpart to compare with: torch has no in-memory checkpoint (DCP writes
storage), so the comparison is the same job with and without snapshots, as ratios.
JSON: benchmarks/results/recovery.json. ``--keep DIR`` keeps each run's directory
(DIR/snapshots<i>, DIR/disk_only<i>, with torchrun's output in torchrun.stdout/.stderr there);
tests/test_memory_snapshot_e2e.py checks the snapshot run's checkpoint and messages.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("steps_lost", "resumed_s", "first_step_s", "caught_up_s")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(run_dir: Path, args, memory: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.world_size}",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{_port()}",
        "train.py",
        f"hydra.run.dir={run_dir}",
        f"dist.world_size={args.world_size}",
        f"train.steps={args.steps}",
        f"checkpoint.every_steps={args.every}",
        "checkpoint.resume=latest",
        "checkpoint.verify_resume=false",
        f"checkpoint.memory_every_steps={memory}",
        "fault.kill_rank=1",
        f"fault.kill_at_step={args.kill_at}",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "torchrun.stdout").write_text(proc.stdout)
    (run_dir / "torchrun.stderr").write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    restart = next(i for i, r in enumerate(records) if r.get("event") == "restart")
    killed = next(r for r in records[:restart] if r["type"] == "step" and r["step"] == args.kill_at)
    after = [r for r in records[restart:] if r["type"] == "step"]
    resumed = records[restart]["step"]
    caught = next(r for r in after if r["step"] == args.kill_at + 1)
    return {
        "steps_lost": args.kill_at - resumed,
        "resumed_after": resumed,
        "resumed_s": records[restart]["time"] - killed["time"],
        "first_step_s": after[0]["time"] - killed["time"],
        "caught_up_s": caught["time"] - killed["time"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kill-at", type=int, default=19)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recovery.json"))
    parser.add_argument("--keep", default=None, help="keep the run directories under this directory")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"snapshots": [], "disk only": []}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        for i in range(args.repeats):
            order = list(runs) if i % 2 == 0 else list(runs)[::-1]
            for name in order:
                runs[name].append(
                    run_once(Path(tmp) / f"{name.replace(' ', '_')}{i}", args, int(name == "snapshots"))
                )
    rows = {name: {k: statistics.median(r[k] for r in rs) for k in KEYS} for name, rs in runs.items()}
    print(
        f"SIGKILL of rank 1 after step {args.kill_at} of {args.steps}, {args.world_size} ranks, "
        f"disk checkpoints "
        f"every {args.every} steps; median of {args.repeats}"
    )
    print(f"{'variant':<12} {'steps lost':>10} {'resumed s':>10} {'first step s':>13} {'caught up s':>12}")
    for name, row in rows.items():
        print(
            f"{name:<12} {row['steps_lost']:>10.0f} {row['resumed_s']:>10.2f} {row['first_step_s']:>13.2f} "
            f"{row['caught_up_s']:>12.2f}"
        )
    snap, disk = rows["snapshots"], rows["disk only"]
    print(
        f"caught up: snapshots / disk only = {snap['caught_up_s'] / disk['caught_up_s']:.2f}; "
        f"first step: {snap['first_step_s'] / disk['first_step_s']:.2f}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "median": rows, "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
