"""A kill loop (torchft's punisher, in small): K SIGKILLs of random ranks at random moments of one job.

    .venv/bin/python benchmarks/chaos.py [--kills 20] [--world-size 4] [--seed 0]
                                         [--launchers torchrun,own,standby] [--keep DIR]

The capstone with snapshots every step and disk checkpoints every few steps
(``checkpoint.resume=latest``), under each launcher in turn: ``torchrun --max-restarts K`` (every
worker restarts after a kill), ``python train.py dist.max_restarts=K`` (own: the lost worker
alone is replaced, the others stay in their processes; distlib/launch/agent.py) and the same with
``dist.standbys=1`` (standby: the replacement is a worker started beforehand and waiting,
distlib/launch/standby.py). Each kill picks,
from a seeded generator, a rank (every rank in turn of a shuffled order, so rank 0 is hit too) and
a moment: inside a step, inside a disk save (its ``.partial`` directory exists), or inside a
snapshot round (the job's /dev/shm directory holds two steps' files); the job is given 3 steps
between kills. At the end, per launcher: every kill survived (the job finished), steps lost per
kill (<= 1 expected: snapshots every step), the final checkpoint byte-identical to an
uninterrupted run's (every file's sha256), /dev/shm clean, and the recovery time from each kill to
the next step (median and max). tests/test_chaos.py runs it small. JSON: benchmarks/results/chaos.json.
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
from _torchrun_job import ROOT, Job  # noqa: E402

sys.path.insert(0, str(ROOT))
from distlib.checkpoint import memory_snapshot as shm  # noqa: E402
from distlib.checkpoint import sharded as checkpoint  # noqa: E402

MOMENTS = ("step", "save", "snapshot")
LAUNCHERS = {"torchrun": Job, "own": OwnJob, "standby": StandbyJob}


def overrides(world_size: int, steps: int, every: int) -> list[str]:
    return [
        f"dist.world_size={world_size}",
        f"train.steps={steps}",
        f"checkpoint.every_steps={every}",
        "checkpoint.resume=latest",
        "checkpoint.memory_every_steps=1",
        "checkpoint.verify_resume=false",
        "metrics.progress_every=0",
    ]


def _in_save(job: Job) -> bool:
    return any(p.name.endswith(".partial") for p in (job.run_dir / "checkpoints").glob(".step_*"))


def _in_snapshot(job: Job) -> bool:
    steps = {p.name[:12] for p in shm.job_dir(job.run_dir).glob("step*.safetensors*")}
    return len(steps) > 1


def _wait_moment(job: Job, moment: str, rng: random.Random, patience_s: float = 10.0) -> str:
    """Return at the chosen moment (or, if a save or snapshot round was not caught within
    ``patience_s``, inside a step); the moment it was."""
    if moment != "step":
        caught = _in_save if moment == "save" else _in_snapshot
        deadline = time.monotonic() + patience_s
        while time.monotonic() < deadline and job.proc.poll() is None:
            if caught(job):
                return moment
            time.sleep(0.0005)
    time.sleep(rng.random() * 0.03)
    return "step"


def final_files(run_dir: Path, steps: int) -> dict[str, str]:
    manifest = checkpoint.verify(run_dir / "checkpoints" / checkpoint.step_dir_name(steps))
    return {f["path"]: f["sha256"] for f in manifest["files"]}


def _steps(kills: int, every: int) -> int:
    """Enough steps that each kill may use 3 steps of its start, up to a save interval to catch a
    save, and a step lost."""
    return every * (2 + ((3 + every + 1) * (kills + 1)) // every)


def steps_lost(records: list[dict], t_kill: float) -> int:
    """Steps recorded before the kill that the restart after it runs again: the newest step whose
    record rank 0 made before ``t_kill``, less the step the restart resumed from. Never below 0:
    the restart may resume from a step rank 0 recorded only after ``t_kill`` (the kill reached its
    rank after ``t_kill`` was read, or rank 0 lagged the killed rank, whose snapshot of the step was
    already written: on a loaded machine both happen), and then no step is run again."""
    done = max(r["step"] for r in records if r["type"] == "step" and r["time"] < t_kill)
    restart = next(r for r in records if r.get("event") == "restart" and r["time"] > t_kill)
    return max(0, done - restart["step"])


def reference_run(base: Path, kills: int, world_size: int, every: int = 5, extra: tuple = ()) -> Path:
    """The uninterrupted job the kill loops' final checkpoints are compared with; its directory."""
    args = [*overrides(world_size, _steps(kills, every), every), *extra]
    reference = Job(base / "reference", args, world_size).start()
    if reference.finish() != 0:
        raise SystemExit(f"the uninterrupted run failed: {reference.tail()}")
    return reference.run_dir


def run(
    base: Path,
    kills: int,
    world_size: int,
    seed: int,
    every: int = 5,
    launcher: str = "torchrun",
    reference: Path | None = None,
    extra: tuple = (),
) -> dict:
    """The kill loop of ``kills`` kills under ``launcher`` (torchrun: every worker restarts; own:
    python train.py's agent, the lost worker alone is replaced), after the uninterrupted job
    (``reference``: its directory, if it ran already); ``extra``: overrides of both jobs.
    Everything to judge it by."""
    steps = _steps(kills, every)
    reference = reference or reference_run(base, kills, world_size, every, extra)
    rng = random.Random(seed)
    order = []
    args = [*overrides(world_size, steps, every), *extra]
    job = LAUNCHERS[launcher](base / f"chaos_{launcher}", args, world_size, kills)
    job.start()
    rows = []
    for attempt in range(kills):
        if not order:
            order = rng.sample(range(world_size), world_size)
        begun = job.last_step()
        job.wait_for(lambda b=begun: job.last_step() >= b + 3, what="3 steps of this start")
        moment = _wait_moment(job, MOMENTS[attempt % len(MOMENTS)], rng)
        victims = job.ranks()
        idle = job.standby_memory() if launcher == "standby" else []
        rank = order.pop()
        t_kill = job.kill(victims[rank])
        job.wait_for(
            lambda t=t_kill: any(r.get("event") == "restart" and r["time"] > t for r in job.records()),
            what="the restart",
        )
        row = {"rank": rank, "moment": moment, "t": t_kill, "pid": victims[rank], "attempt": attempt}
        rows.append({**row, "replacement": job.ranks().get(rank), "standbys_idle": idle})
    code = job.finish()
    records = job.records()
    for row in rows:
        row["steps_lost"] = steps_lost(records, row["t"])
        row["phases_s"] = job.phases(row["t"], row["pid"], row["attempt"])
        row["first_step_s"] = row["phases_s"]["first step"]
        # the rank's new worker was a standby already waiting when the kill came
        row["from_standby"] = getattr(job, "standby_seen", {}).get(row["replacement"], row["t"]) < row["t"]
    same = code == 0 and final_files(job.run_dir, steps) == final_files(reference, steps)
    recorded = [r["step"] for r in records if r["type"] == "step"]
    return {
        "launcher": launcher,
        "exit_code": code,
        "kills": rows,
        "byte_identical": same,
        "worker_processes": len(job.seen),  # every worker process the job ran, the replacements too
        "steps": steps,
        # metrics.jsonl: steps never recorded, and records beyond one per step (a step run again)
        "steps_unrecorded": sorted(set(range(1, steps + 1)) - set(recorded)),
        "records_repeated": len(recorded) - len(set(recorded)),
        "shm_clean": not shm.job_dir(job.run_dir).exists() and not shm.job_dir(reference).exists(),
        # saves a kill interrupted, never committed: the job's end removes them
        "partials_left": sorted(p.name for p in (job.run_dir / "checkpoints").glob(".step_*.partial")),
        "stderr_tail": job.tail() if code else "",
    }


def _report(result: dict, args) -> None:
    kills = result["kills"]
    times = [k["first_step_s"] for k in kills if k["first_step_s"] is not None]
    moments = {m: sum(k["moment"] == m for k in kills) for m in MOMENTS}
    lost = [k["steps_lost"] for k in kills]
    print(f"{result['launcher']}: {LAUNCHER_WORDS[result['launcher']]}")
    print(
        f"  faults survived: {len(kills) if result['exit_code'] == 0 else 0} of {args.kills} "
        f"(moments: {moments}; ranks hit: {sorted({k['rank'] for k in kills})})"
    )
    print(f"  steps lost: total {sum(lost)}, at most {max(lost)} per kill")
    print(
        f"  metrics.jsonl: {len(result['steps_unrecorded'])} steps unrecorded, "
        f"{result['records_repeated']} recorded twice"
    )
    print(f"  kill -> next step: median {statistics.median(times):.2f} s, max {max(times):.2f} s")
    if result["launcher"] == "standby":
        print(f"  replacements that were standbys already waiting: {sum(k['from_standby'] for k in kills)}")
        idle = [m for k in kills for m in k["standbys_idle"]]
        mb = {what: max(m[what] for m in idle) / 2**20 for what in ("private", "pss")}
        print(f"  an idle standby's memory: at most {mb['private']:.1f} MiB its own, {mb['pss']:.1f} MiB PSS")
    print(
        f"  final checkpoint byte-identical to an uninterrupted run: {result['byte_identical']}; "
        f"/dev/shm clean: {result['shm_clean']}; unfinished saves left: {len(result['partials_left'])}"
    )


LAUNCHER_WORDS = {
    "torchrun": "torchrun --max-restarts, every worker restarts",
    "own": "python train.py dist.max_restarts, the lost worker is replaced and the others stay",
    "standby": "the same with dist.standbys=1: a standby started beforehand takes the lost worker's place",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--launchers", default="torchrun,own,standby", help="comma-separated: torchrun, own, standby"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos.json"))
    parser.add_argument("--keep", default=None, help="keep the jobs' directories under this directory")
    args = parser.parse_args()
    launchers = args.launchers.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(args.keep or scratch)
        reference = reference_run(base, args.kills, args.world_size)
        results = [
            run(base, args.kills, args.world_size, args.seed, launcher=n, reference=reference)
            for n in launchers
        ]
    print(f"{args.kills} SIGKILLs, {args.world_size} ranks, seed {args.seed}, {results[0]['steps']} steps")
    for result in results:
        _report(result, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "launchers": results}, indent=2))
    print(f"wrote {out}")
    if any(r["exit_code"] != 0 or not r["byte_identical"] or not r["shm_clean"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
