"""Recovery from a killed worker under torchrun: where the seconds go, from the kill to the next step.

    .venv/bin/python benchmarks/recovery.py [--world-size 4] [--steps 24] [--kill-at 19] [--every 10]
                                            [--repeats 2] [--external 5] [--seed 0] [--keep DIR]

Three ways a worker dies, the capstone on ``--world-size`` ranks under
``torchrun --max-restarts``, ``checkpoint.resume=latest``, disk checkpoints every ``--every`` steps:

  external       SIGKILL of a random rank (rank 0 included) at a random moment of a step, sent
                 from outside (what a real crash looks like), ``--external`` times in one job
                 (snapshots every step: ``checkpoint.memory_every_steps=1``)
  in place       the same kills under ``python train.py dist.max_restarts`` instead of torchrun:
                 the lost worker alone is replaced, the others stay (distlib/launch/agent.py);
                 its phases are the replacement's start and the first step
  standby        the same with ``dist.standbys=1``: the lost worker's place goes to an idle worker
                 started with the job (distlib/launch/standby.py)
  fault, snap    ``fault.kill_rank=1 fault.kill_at_step=--kill-at``: rank 1 kills itself after that
                 step (snapshots every step), ``--repeats`` jobs
  fault, disk    the same without snapshots (disk checkpoints only), ``--repeats`` jobs

For every kill, seconds from the kill to: noticed (a survivor saw the failed collective or the
launcher's signal), survivors gone (every other worker exited), workers started, imports done,
group formed, state restored, first step (benchmarks/_torchrun_job.py: worker marks plus a watch
on torchrun's children); and steps lost (the last step completed before the kill minus the step
the restart resumed after). Medians per row. torch has no in-memory checkpoint to compare with
(DCP writes storage), so the snapshot rows compare with the disk row as ratios.
JSON: benchmarks/results/recovery.json. ``--keep DIR`` keeps each job's directory
(DIR/snapshots<i>, DIR/disk_only<i>, DIR/external) with torchrun's output in torchrun.stdout/.stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _own_job import OwnJob, StandbyJob  # noqa: E402
from _torchrun_job import PHASES, ROOT, Job  # noqa: E402
from chaos import steps_lost  # noqa: E402

KEYS = ("steps_lost", *PHASES)


def _base(args, memory: int) -> list[str]:
    return [
        f"dist.world_size={args.world_size}",
        f"train.steps={args.steps}",
        f"checkpoint.every_steps={args.every}",
        "checkpoint.resume=latest",
        "checkpoint.verify_resume=false",
        f"checkpoint.memory_every_steps={memory}",
        "metrics.progress_every=0",
    ]


def _keep_output(job: Job) -> None:
    job.run_dir.mkdir(parents=True, exist_ok=True)
    stdout, stderr = job.output()
    (job.run_dir / "torchrun.stdout").write_text(stdout)
    (job.run_dir / "torchrun.stderr").write_text(stderr)


def _restart_after(job: Job, t_kill: float) -> dict:
    return next(r for r in job.records() if r.get("event") == "restart" and r["time"] > t_kill)


def fault_run(run_dir: Path, args, memory: int) -> dict:
    """One job whose rank 1 kills itself after --kill-at: its steps lost and phases."""
    job = Job(
        run_dir,
        [*_base(args, memory), "fault.kill_rank=1", f"fault.kill_at_step={args.kill_at}"],
        args.world_size,
        max_restarts=1,
    ).start()
    code = job.finish()
    _keep_output(job)
    if code != 0:
        raise SystemExit(f"run failed ({code}): {job.tail()}")
    killed = next(r for r in job.records() if r["type"] == "step" and r["step"] == args.kill_at)
    # the kill: rank 1's own mark just before its SIGKILL, else rank 0's record of that step
    t_kill = killed["time"]
    from _trace_worker import read

    for name, wall, _ in read(str(job.trace_dir)).get((1, 0), []):
        if name == "killing itself":
            t_kill = wall
    return {"steps_lost": args.kill_at - _restart_after(job, t_kill)["step"], **job.phases(t_kill, None, 0)}


def external_run(run_dir: Path, args, rng: random.Random, launcher=Job) -> list[dict]:
    """One job, --external SIGKILLs of random ranks at random moments: a row per kill. ``launcher``:
    Job (torchrun), OwnJob (python train.py dist.max_restarts: the others stay) or StandbyJob (the
    same with a warm standby)."""
    steps = max(args.steps, 6 * (args.external + 1))
    job = launcher(
        run_dir, [*_base(args, 1), f"train.steps={steps}"], args.world_size, max_restarts=args.external
    ).start()
    kills = []
    for attempt in range(args.external):
        begun = job.last_step()
        job.wait_for(lambda b=begun: job.last_step() >= b + 3, what="3 steps of this start")
        time.sleep(rng.random() * 0.05)  # somewhere inside a step (steps take ~20-60 ms here)
        victim = rng.choice(job.workers())
        t_kill = job.kill(victim)
        job.wait_for(
            lambda t=t_kill: any(r.get("event") == "restart" and r["time"] > t for r in job.records()),
            what="the restart",
        )
        kills.append((t_kill, victim, attempt))
    code = job.finish()
    _keep_output(job)
    if code != 0:
        raise SystemExit(f"run failed ({code}): {job.tail()}")
    records = job.records()
    return [{"steps_lost": steps_lost(records, t), **job.phases(t, v, a)} for t, v, a in kills]


def _median(rows: list[dict]) -> dict:
    return {
        k: statistics.median(r[k] for r in rows if r.get(k) is not None)
        for k in KEYS
        if any(r.get(k) is not None for r in rows)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kill-at", type=int, default=19)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--external", type=int, default=5, help="external kills (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recovery.json"))
    parser.add_argument("--keep", default=None, help="keep the run directories under this directory")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {
        n: [] for n in ("external", "in place", "standby", "snapshots", "disk only")
    }
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        for i in range(args.repeats):
            order = ["snapshots", "disk only"] if i % 2 == 0 else ["disk only", "snapshots"]
            for name in order:
                runs[name].append(
                    fault_run(tmp / f"{name.replace(' ', '_')}{i}", args, int(name == "snapshots"))
                )
        if args.external:
            runs["external"] = external_run(tmp / "external", args, random.Random(args.seed))
            runs["in place"] = external_run(tmp / "in_place", args, random.Random(args.seed), OwnJob)
            runs["standby"] = external_run(tmp / "standby", args, random.Random(args.seed), StandbyJob)
    rows = {name: _median(rs) for name, rs in runs.items() if rs}
    print(f"{args.world_size} ranks; seconds from the kill (median of each row's kills)")
    print(
        f"{'variant':<11} {'kills':>5} {'lost':>5}"
        + "".join(
            f" {p:>9}" for p in ("noticed", "gone", "started", "imported", "group", "restored", "1st step")
        )
    )
    for name, row in rows.items():
        cells = "".join(f" {row.get(p, float('nan')):>9.2f}" for p in PHASES)
        print(f"{name:<11} {len(runs[name]):>5} {row['steps_lost']:>5.0f}{cells}")
    if "snapshots" in rows and "disk only" in rows:
        snap, disk = rows["snapshots"], rows["disk only"]
        print(f"first step: snapshots / disk only = {snap['first step'] / disk['first step']:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "median": rows, "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
