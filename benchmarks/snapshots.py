"""What in-memory snapshots cost a step (``checkpoint.memory_every_steps=1``; issue #40 item 3).

    .venv/bin/python benchmarks/snapshots.py            # 4 ranks, 3 rounds of 12 steps per variant: ~75 s
    .venv/bin/python benchmarks/snapshots.py --quick    # 1 round of 4 steps: ~15 s

The trainer on ``--world-size`` forked ranks, the capstone's model at benchmarks/step.py's medium
shape (2 blocks of dim 256, 8 heads, 128 tokens, 8 sequences per rank; ZeRO ``--stage``), three
variants, run in turn in each round so that a load change hits all of them:

  off        memory_every_steps=0
  own        =1: after every step each rank encodes its shard (the bytes a disk checkpoint holds),
             hashes it and writes it to /dev/shm, then one small all-reduce commits the round
  replica    =1 on two simulated nodes (LOCAL_WORLD_SIZE = world / 2, each node its own directory
             in /dev/shm): also each rank's shard to a rank of the other node, which keeps it

ms per step: the median interval between consecutive step records of rank 0's metrics.jsonl (the
first two steps of a run left out), so a step's snapshot counts in the step after it; ``cost`` =
variant / off - 1; ``CPU ms``: a rank's process CPU in a snapshot round, ``share``: that over the
rank's CPU of a step (medians), what the round costs a step on a machine with no core to spare.
Memory: the bytes of /dev/shm each rank holds before its last step (its own snapshot, and with
replicas its peer's: twice its shard), + the spares (the previous round's files, which the next
round is written into). On one host the replica travels through
the shared-memory transport; between real hosts it crosses the network (gloo's TCP pairs), which
this run does not measure. torch has no in-memory snapshot to compare with (DCP writes storage), so
the rows compare with ``off``. JSON: benchmarks/results/snapshots.json (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from multiproc import run_ranks  # noqa: E402
from trainrun import compose_tree  # noqa: E402

from distlib.app.checkpointing.memory_snapshots import MemorySnapshots  # noqa: E402
from distlib.app.config.run import RunConfig  # noqa: E402
from distlib.app.runtime.hooks import StepHooks  # noqa: E402
from distlib.app.trainer import Trainer  # noqa: E402
from distlib.checkpoint import memory_snapshot as shm  # noqa: E402

MEDIUM = ["model.vocab_size=256", "model.seq_len=128", "model.dim=256", "model.n_heads=8", "model.n_layers=2"]
VARIANTS = ("off", "own", "replica")


class _Holdings(StepHooks):
    """Before the last step: the snapshot bytes this rank holds, by the rank whose shard each is
    (files ``*.rank<owner>.held<rank>.*`` in its node's directory; the run's end removes them).
    And this process's CPU time of each step (between two ``before_step``s)."""

    def __init__(self, last: int, memory: Path, rank: int):
        self.last, self.memory, self.rank, self.held, self.spare = last, memory, rank, None, 0
        self.cpu: list[float] = []  # the process's CPU seconds at each step's start

    def before_step(self, step: int) -> None:
        self.cpu.append(time.process_time())
        if step == self.last:
            files = self.memory.rglob(f"*.held{self.rank:05d}.safetensors")
            self.held = {int(f.name.split(".rank")[1][:5]): f.stat().st_size for f in files}
            spares = self.memory.rglob(f"*.held{self.rank:05d}.spare")  # (the next round's files)
            self.spare = sum(f.stat().st_size for f in spares)


def _rank(comm, tree: dict, run_dir: str, memory: str, nodes: int) -> dict:
    """One rank of one run (its node's snapshots in ``memory``/node<n>): the bytes it held, by owner,
    its spares' bytes, and its CPU seconds of each snapshot round and of each step."""
    per_node = comm.size // nodes
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(per_node), str(comm.rank % per_node)
    # (the transport's segments go there too: every group's in its rank 0's node directory)
    node = Path(memory) / f"node{comm.rank // per_node}"
    node.mkdir(exist_ok=True)
    os.environ["DISTLIB_SHM_DIR"] = str(node)
    hooks = _Holdings(tree["train"]["steps"], node, comm.rank)
    spent: list[float] = []  # the CPU seconds of each snapshot round (asleep in its all-reduce: none)
    taking = MemorySnapshots.after_step

    def timed(self, step, state) -> None:
        start = time.process_time()
        taking(self, step, state)
        spent.append(time.process_time() - start)

    MemorySnapshots.after_step = timed  # (a forked rank's own copy of the class)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        Trainer(RunConfig.from_dict(tree), comm, Path(run_dir), hooks=hooks).run()
    steps = [b - a for a, b in zip(hooks.cpu, hooks.cpu[1:])][2:]  # (two warm-up steps)
    return {"held": hooks.held, "spare": hooks.spare, "snapshot_cpu": spent[2:], "step_cpu": steps}


def _one(variant: str, world: int, stage: int, steps: int) -> tuple[list[float], list[dict]]:
    """Step intervals (s) of one run of ``variant``, and per rank the snapshot bytes it held, by
    owner, and its CPU seconds of each snapshot round and of each step."""
    every = 0 if variant == "off" else 1
    tree = compose_tree(
        [*MEDIUM, f"dist.world_size={world}", f"zero.stage={stage}", f"train.global_batch={8 * world}"]
        + [f"train.steps={steps}", "checkpoint.every_steps=0", "checkpoint.verify_resume=false"]
        + [f"checkpoint.memory_every_steps={every}", "metrics.progress_every=0"]
    )
    nodes = 2 if variant == "replica" else 1
    with tempfile.TemporaryDirectory() as run_dir, tempfile.TemporaryDirectory(dir=shm.SHM) as memory:
        held = run_ranks(_rank, world, tree, run_dir, memory, nodes, timeout_s=600)
        records = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    times = [r["time"] for r in records if r["type"] == "step"][2:]  # two warm-up steps
    return [b - a for a, b in zip(times, times[1:])], held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 4 steps per variant")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--stage", type=int, default=1, help="zero.stage of every variant")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "snapshots.json"))
    args = ap.parse_args()
    rounds, steps = (1, 4) if args.quick else (args.rounds, args.steps)
    if args.world_size < 2 or args.world_size % 2:
        sys.exit("error: --world-size must be even and at least 2 (the replica variant is 2 nodes)")
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    intervals = {v: [] for v in VARIANTS}
    ranks, snapshot_cpu, step_cpu = {}, {v: [] for v in VARIANTS}, {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            got, ranks[variant] = _one(variant, args.world_size, args.stage, steps)
            intervals[variant] += got
            for r in ranks[variant]:
                snapshot_cpu[variant] += r["snapshot_cpu"]
                step_cpu[variant] += r["step_cpu"]
    off = statistics.median(intervals["off"])
    rows = []
    for v in VARIANTS:
        ms = statistics.median(intervals[v]) * 1e3
        held = [r["held"] for r in ranks[v]]
        taken = statistics.median(snapshot_cpu[v]) * 1e3 if snapshot_cpu[v] else 0.0
        share = taken / (statistics.median(step_cpu[v]) * 1e3)
        rows.append(
            dict(variant=v, ms=ms, cost=ms / (off * 1e3) - 1, snapshot_cpu_ms=taken, cpu_share=share)
            | dict(held_bytes=[sum(h.values()) for h in held], held_by_owner=held)
            | dict(spare_bytes=[r["spare"] for r in ranks[v]])
        )
    print(
        f"{args.world_size} ranks, ZeRO-{args.stage}, medium model: ms per step (median); a rank's CPU ms"
        " of a snapshot round (median) and its share of the rank's step CPU; /dev/shm held"
    )
    print(f"{'variant':<9}{'ms':>8}{'cost':>8}{'CPU ms':>8}{'share':>8}  bytes held per rank (+ spares)")
    for r in rows:
        held = [f"{b:,} + {spare:,}" for b, spare in zip(r["held_bytes"], r["spare_bytes"])]
        bytes_held = "-" if r["variant"] == "off" else ", ".join(held)
        cpu = f"{r['snapshot_cpu_ms']:>8.2f}{r['cpu_share']:>8.1%}"
        print(f"{r['variant']:<9}{r['ms']:>8.1f}{r['cost']:>8.1%}{cpu}  {bytes_held}")
    load_after = os.getloadavg()[0]
    print(f"1-min load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} cores")
    record = dict(
        quick=args.quick,
        world_size=args.world_size,
        stage=args.stage,
        rounds=rounds,
        steps=steps,
        model=MEDIUM,
        torch=torch.__version__,
        cores=os.cpu_count(),
        loadavg_1min=[load_before, load_after],
        unit="ms per step, median interval between step records; cost = ms / off ms - 1; snapshot_cpu_ms:"
        " a rank's process CPU in a snapshot round (median over ranks and steps); cpu_share: that over a"
        " rank's step CPU (median)",
        rows=rows,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
