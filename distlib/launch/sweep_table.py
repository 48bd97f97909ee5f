"""The table that ends a Hydra sweep: every job's loss trajectory against world size 1.

    python train.py -m dist.world_size=1,2,4 zero.stage=0,1,2,3 train.global_batch=16

Registered as a Hydra callback in conf/config.yaml; after the last job it reads each
job's ``.hydra/config.yaml`` and its ``metrics.file`` step records (written by rank 0) and prints one
row per job: layout, final loss, the largest absolute and relative loss difference,
step for step, against the world-size-1 job of the same stage (or any world-size-1
job with the same global batch and dtype), optimizer bytes per rank, data-parallel
bytes sent per step and the median step time. It also writes ``comparison.json``
into the sweep directory. The verdict line covers fp32 jobs: with a fixed global
batch their losses must agree within ``INVARIANCE_RTOL`` per step.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from distlib.app.config.run import RunConfig

INVARIANCE_RTOL = 1e-5


def read_job(job_dir: Path) -> dict | None:
    config = job_dir / ".hydra" / "config.yaml"
    if not config.is_file():
        return None
    cfg = OmegaConf.load(config)
    metrics = job_dir / str(OmegaConf.select(cfg, "metrics.file", default="metrics.jsonl"))
    if not metrics.is_file():
        return None
    steps: dict[int, dict] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if row.get("type", "step") == "step" and "loss" in row:
            steps[row["step"]] = row  # a resumed or rolled-back run rewrites later steps; keep the last
    if not steps:
        return None
    # The job's own checked config gives its global batch: the layout's data-parallel ranks (not
    # the world over tp x pp, which counts the context-parallel ranks too) x batch_size x grad_accum.
    run = RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    ordered = [steps[k] for k in sorted(steps)]
    return {
        "job": job_dir.name,
        "world_size": run.dist.world_size,
        "tp": run.dist.tp,
        "stage": run.zero.stage,
        "dtype": run.train.dtype,
        "global_batch": run.global_batch,
        "losses": [float(r["loss"]) for r in ordered],
        "final_loss": float(ordered[-1]["loss"]),
        "optimizer_bytes": _max_optimizer_bytes(ordered[-1]),
        "dp_comm_bytes": (ordered[-1].get("comm_bytes") or {}).get("dp"),
        "step_ms": 1000 * statistics.median(r["step_time_s"] for r in ordered),
    }


def _max_optimizer_bytes(record: dict) -> int | None:
    """The largest rank's optimizer bytes (the step record's memory.optimizer_bytes.max)."""
    value = (record.get("memory") or {}).get("optimizer_bytes", {}).get("max")
    return None if value is None else int(value)


def _reference(job: dict, jobs: list[dict]) -> dict | None:
    candidates = [
        j
        for j in jobs
        if j["world_size"] == 1 and j["global_batch"] == job["global_batch"] and j["dtype"] == job["dtype"]
    ]
    same_stage = [j for j in candidates if j["stage"] == job["stage"]]
    return (same_stage or candidates or [None])[0]


def compare(jobs: list[dict]) -> list[dict]:
    for job in jobs:
        ref = _reference(job, jobs)
        job["reference"] = ref["job"] if ref else None
        if ref is None or len(ref["losses"]) != len(job["losses"]):
            job["max_abs_diff"] = job["max_rel_diff"] = None
            continue
        diffs = [abs(a - b) for a, b in zip(job["losses"], ref["losses"])]
        job["max_abs_diff"] = max(diffs)
        job["max_rel_diff"] = max(d / abs(b) for d, b in zip(diffs, ref["losses"]))
    return jobs


def table(jobs: list[dict]) -> str:
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [
        f"{'job':<22} {'ws':>3} {'tp':>3} {'stage':>5} {'dtype':>5} {'final loss':>11} "
        f"{'max|dloss| vs ws1':>17} {'max rel':>9} {'optim B/rank':>12} {'DP B/step':>10} {'step ms':>8}"
    ]
    for j in jobs:
        lines.append(
            f"{j['job']:<22} {j['world_size']:>3} {j['tp']:>3} {j['stage']:>5} {j['dtype']:>5} "
            f"{j['final_loss']:>11.6f} {fmt(j['max_abs_diff'], '>17.3e')} {fmt(j['max_rel_diff'], '>9.2e')} "
            f"{fmt(j['optimizer_bytes'], '>12')} {fmt(j['dp_comm_bytes'], '>10')} {j['step_ms']:>8.1f}"
        )
    checked = [
        j for j in jobs if j["dtype"] == "fp32" and j["max_rel_diff"] is not None and j["world_size"] > 1
    ]
    if checked:
        worst = max(checked, key=lambda j: j["max_rel_diff"])
        ok = worst["max_rel_diff"] <= INVARIANCE_RTOL
        lines.append(
            f"world-size invariance ({len(checked)} fp32 job(s) vs world size 1): max relative loss "
            f"difference {worst['max_rel_diff']:.2e} ({worst['job']}) "
            f"{'<=' if ok else '>'} {INVARIANCE_RTOL:g}: {'OK' if ok else 'EXCEEDED'}"
        )
    else:
        lines.append(
            "world-size invariance: not checked (no fp32 job with a world-size-1 job of the same "
            "global batch; set train.global_batch and include dist.world_size=1)"
        )
    return "\n".join(lines)


class SweepTable(Callback):
    """Hydra callback: print the comparison table after a multirun."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return

        def job_number(d: Path):
            head = d.name.split("_")[0]
            return (int(head) if head.isdigit() else float("inf"), d.name)

        jobs = [j for d in sorted(sweep_dir.iterdir(), key=job_number) if d.is_dir() and (j := read_job(d))]
        if not jobs:
            print(f"sweep: no job in {sweep_dir} wrote metrics.jsonl")
            return
        jobs = compare(jobs)
        print(f"\nsweep comparison ({sweep_dir})")
        print(table(jobs), flush=True)
        (sweep_dir / "comparison.json").write_text(json.dumps(jobs, indent=2))
