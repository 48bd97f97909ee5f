"""Wall time of the capstone, `torchrun --nproc_per_node 4 train.py`, against torchrun's own floor.

    .venv/bin/python benchmarks/startup.py            # 3 rounds (~2 min on 2 cores)
    .venv/bin/python benchmarks/startup.py --quick    # 1 round (~50 s)
    .venv/bin/python benchmarks/startup.py dist.check_collectives=false   # a what-if, with overrides

The floor is the same torchrun command running a script that only imports torch, joins the
gloo process group and leaves (what any torchrun job pays before doing anything); the goal
(<= 1.2) is judged on ratio = capstone / floor. train.py also pauses the garbage collector for its
imports, which the floor's plain ``import torch`` does not, so a second floor, the same script with
the collector paused the same way, shows what the capstone costs beyond that saving. Rounds run
the three in turn, each first in turn, so background load hits all alike; the table reports
median wall and CPU times. distlib's modules are compiled first (as an interpreter caches them
unless PYTHONDONTWRITEBYTECODE is set).

Then one traced run of each breaks the time down: every worker records when it reached each
phase (imports, Hydra, process group, trainer built, training loop, checkpoint saves, resume
check, exit) by wrapping train.py's collaborators from outside (benchmarks/_trace_worker.py
runs train.py with runpy, so train.py itself carries no timing code). Phases are printed as
seconds since torchrun was started, for rank 0 and the slowest rank.
JSON: benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _trace_worker
NPROC = 4
GOAL = 1.2
# The same capstone started by `python train.py` (its own launcher, distlib/launch/local.py): its
# fork server a fork of the launcher (prefork.py), and multiprocessing's own fresh interpreter, which
# a launcher gets when a thread runs in it (numpy's BLAS pool, kept here by OPENBLAS_NUM_THREADS=2).
LAUNCHERS = {"python train.py": {}, "python train.py, exec'd server": {"OPENBLAS_NUM_THREADS": "2"}}

FLOOR_SCRIPT = """\
import gc, os, sys, time
sys.path.insert(0, {here!r})
from _trace_worker import Marks
marks = Marks.from_env()
{pause}import torch
import torch.distributed as dist
{resume}marks.mark("imports")
dist.init_process_group("gloo")
marks.mark("process group")
dist.destroy_process_group()
marks.mark("destroyed")
"""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], env: dict, timeout: float, capstone: bool) -> tuple[float, float]:
    """Run ``cmd`` from the repository root; its wall seconds and the CPU seconds it and every
    process it reaped used (torchrun reaps its workers; python train.py its fork server, which
    reaped the workers). A capstone run must print RESUME VERIFIED."""
    cpu_before = _children_cpu()
    began = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    elapsed, cpu = time.perf_counter() - began, _children_cpu() - cpu_before
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    if capstone and "RESUME VERIFIED" not in proc.stdout:
        sys.exit(f"error: the capstone run did not print RESUME VERIFIED:\n{proc.stdout[-3000:]}")
    return elapsed, cpu


def torchrun(script: str, args: list[str], env: dict, timeout: float) -> tuple[float, float]:
    """``torchrun --nproc_per_node 4 script args`` on a free port, ``timed``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(NPROC),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        script,
        *args,
    ]
    return timed(cmd, env, timeout, capstone=script.endswith("train.py") or "_trace_worker" in script)


def launcher(args: list[str], env: dict, timeout: float) -> tuple[float, float]:
    """``python train.py args`` (its own launcher, 4 workers), ``timed``."""
    return timed([sys.executable, os.path.join(ROOT, "train.py"), *args], env, timeout, capstone=True)


def read_marks(trace_dir: str, launched_at: float) -> dict[int, dict[str, tuple[float, float]]]:
    """Per rank: phase -> (seconds since torchrun was launched, CPU seconds this process had used)."""
    from _trace_worker import read

    return {
        rank: {phase: (wall - launched_at, cpu) for phase, wall, cpu in marks}
        for (rank, _attempt), marks in read(trace_dir).items()
    }


def traced(script_args: list, trace_dir: str, env: dict, timeout: float) -> tuple[float, dict]:
    env = {**env, "DISTLIB_TRACE_DIR": trace_dir}
    launched_at = time.time()
    wall, _ = torchrun(*script_args, env=env, timeout=timeout)
    return wall, read_marks(trace_dir, launched_at)


def phase_rows(marks: dict[int, dict[str, tuple[float, float]]]) -> list[dict]:
    """Per phase: when rank 0 and the slowest rank finished it, the longest any rank spent in it,
    and the CPU seconds all ranks together spent in it (the one number load does not inflate much)."""
    names = list(marks[0])
    rows = []
    for i, name in enumerate(names):
        ranks = [r for r, m in marks.items() if name in m and (i == 0 or names[i - 1] in m)]
        prev = names[i - 1] if i else None
        took = max(marks[r][name][0] - (marks[r][prev][0] if prev else 0.0) for r in ranks)
        cpu = sum(marks[r][name][1] - (marks[r][prev][1] if prev else 0.0) for r in ranks)
        rows.append(
            {
                "phase": name,
                "rank0_s": marks[0][name][0],
                "slowest_s": max(marks[r][name][0] for r in ranks),
                "took_s": took,
                "cpu_s_all_ranks": cpu,
            }
        )
    return rows


def print_phases(title: str, rows: list[dict], wall: float) -> None:
    print(f"\n{title}: seconds since torchrun started (a phase ends at its time)")
    print(f"  {'phase ends':<38}{'rank 0':>8}{'slowest':>9}{'longest':>9}{'CPU s, all ranks':>18}")
    for r in rows:
        print(
            f"  {r['phase']:<38}{r['rank0_s']:>8.2f}{r['slowest_s']:>9.2f}{r['took_s']:>9.2f}"
            f"{r['cpu_s_all_ranks']:>18.2f}"
        )
    last = max(r["slowest_s"] for r in rows)
    print(f"  {'torchrun exited':<38}{wall:>8.2f}{wall:>9.2f}{wall - last:>9.2f}{'-':>18}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round instead of three")
    ap.add_argument("--rounds", type=int, help="floor/capstone pairs to time (default 3, --quick 1)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds allowed per torchrun")
    ap.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides for train.py (what-if runs, e.g. "
        "dist.check_collectives=false); the goal is judged on the default capstone",
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "startup.json"))
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "RANK"))}
    env["OMP_NUM_THREADS"] = "1"  # torchrun sets it anyway; saying so silences its banner

    from _trace_worker import compile_distlib

    compile_distlib(ROOT)
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        floors = {"floor": os.path.join(tmp, "floor.py"), "paused floor": os.path.join(tmp, "paused.py")}
        for kind, path in floors.items():
            with open(path, "w") as f:
                paused = kind == "paused floor"  # the collector off for the imports, as train.py has it
                f.write(
                    FLOOR_SCRIPT.format(
                        here=HERE,
                        pause="gc.disable()\n" if paused else "",
                        resume="gc.freeze()\ngc.enable()\n" if paused else "",
                    )
                )
        floor = floors["floor"]
        train = os.path.join(ROOT, "train.py")
        tracer = os.path.join(HERE, "_trace_worker.py")
        kinds = ["floor", "paused floor", "capstone", *LAUNCHERS]
        walls, cpus = {k: [] for k in kinds}, {k: [] for k in kinds}
        for i in range(rounds):
            for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:  # each kind first in turn
                if kind in floors:
                    wall, cpu = torchrun(floors[kind], [], env, args.timeout)
                elif kind in LAUNCHERS:
                    run_dir = f"hydra.run.dir={os.path.join(tmp, f'launcher{kinds.index(kind)}-{i}')}"
                    wall, cpu = launcher([run_dir, *args.overrides], {**env, **LAUNCHERS[kind]}, args.timeout)
                else:
                    wall, cpu = torchrun(
                        train,
                        [f"hydra.run.dir={os.path.join(tmp, f'run{i}')}", *args.overrides],
                        env,
                        args.timeout,
                    )
                walls[kind].append(wall)
                cpus[kind].append(cpu)
                print(f"round {i + 1}/{rounds}: {kind:<12} {wall:6.2f} s wall, {cpu:6.2f} s CPU", flush=True)
        floor_wall, floor_marks = traced([floor, []], os.path.join(tmp, "trace-floor"), env, args.timeout)
        cap_wall, cap_marks = traced(
            [tracer, [train, f"hydra.run.dir={os.path.join(tmp, 'traced')}", *args.overrides]],
            os.path.join(tmp, "trace-capstone"),
            env,
            args.timeout,
        )

    med = {k: statistics.median(v) for k, v in walls.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpus.items()}
    ratio = med["capstone"] / med["floor"]
    paused_ratio = med["capstone"] / med["paused floor"]
    floor_rows, cap_rows = phase_rows(floor_marks), phase_rows(cap_marks)
    print(f"\n{'run':<44}{'wall s':>8}{'min':>7}{'max':>7}{'CPU s':>8}")
    for kind, label in (
        ("floor", "floor: torchrun x4, import torch, init gloo"),
        ("paused floor", "paused floor: the same, collector paused"),
        ("capstone", "capstone: torchrun x4 train.py"),
        ("python train.py", "capstone: python train.py (forked server)"),
        ("python train.py, exec'd server", "the same, server a fresh interpreter"),
    ):
        print(
            f"{label:<44}{med[kind]:>8.2f}{min(walls[kind]):>7.2f}{max(walls[kind]):>7.2f}{med_cpu[kind]:>8.2f}"
        )
    if args.overrides:
        print(f"capstone run with overrides: {' '.join(args.overrides)}")
    print(
        f"capstone / floor = {ratio:.2f} wall (goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'}), "
        f"{med_cpu['capstone'] / med_cpu['floor']:.2f} CPU; medians of {rounds} interleaved round(s)"
    )
    print(
        f"capstone / paused floor = {paused_ratio:.2f} wall, "
        f"{med_cpu['capstone'] / med_cpu['paused floor']:.2f} CPU (train.py pauses the collector for its "
        "imports; this floor does too)"
    )
    (forked, execd), (forked_cpu, execd_cpu) = (med[k] for k in LAUNCHERS), (med_cpu[k] for k in LAUNCHERS)
    ratios = f"{forked / execd:.2f} wall, {forked_cpu / execd_cpu:.2f} CPU"
    print(f"python train.py, its fork server forked / exec'd: {ratios}")
    print_phases(f"floor, traced run ({floor_wall:.2f} s)", floor_rows, floor_wall)
    print_phases(f"capstone, traced run ({cap_wall:.2f} s)", cap_rows, cap_wall)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "quick": args.quick,
                "rounds": rounds,
                "overrides": args.overrides,
                "nproc": NPROC,
                "cores": os.cpu_count(),
                "walls_s": walls,
                "median_s": med,
                "cpu_s": cpus,
                "median_cpu_s": med_cpu,
                "cpu_ratio": med_cpu["capstone"] / med_cpu["floor"],
                "ratio": ratio,
                "paused_floor_ratio": paused_ratio,
                "paused_floor_cpu_ratio": med_cpu["capstone"] / med_cpu["paused floor"],
                "launcher_wall_ratio": forked / execd,
                "launcher_cpu_ratio": forked_cpu / execd_cpu,
                "goal": GOAL,
                "goal_met": ratio <= GOAL,
                "traced": {
                    "floor": {"wall_s": floor_wall, "phases": floor_rows},
                    "capstone": {"wall_s": cap_wall, "phases": cap_rows},
                },
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
