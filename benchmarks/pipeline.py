"""Pipeline schedules measured: bubble fraction against theory, peak activation memory per stage,
step time against torch's own pipelining (torch.distributed.pipelining), in the same run.

    .venv/bin/python benchmarks/pipeline.py                 # pp 2, m 8, 2 interleaved rounds of 4 steps
    .venv/bin/python benchmarks/pipeline.py --quick         # tiny model, 2 steps, 1 round
    .venv/bin/python benchmarks/pipeline.py --pp 2 4

Model: a stack of torch ``nn.TransformerEncoderLayer`` blocks (``--d`` 128, 4 heads, feed-forward
4d, no dropout), ``--layers`` 8 in all, split evenly into P stages (P*v chunks for interleaved),
hidden states (micro-batch 4, ``--tokens`` 64, d) between them, a mean-squared loss after the last. A step is
forward and backward of m micro-batches (no optimizer: both sides run the same update anyway).

Variants, all on the same forked gloo ranks, rotated each step (each after a barrier) so outside
load hits them alike: ours (``distlib.parallel.pipeline.executor``) with GPipe, 1F1B and
interleaved (v=2), and torch's ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``
on the same chunks. Per schedule:
  * step ms: median over steps of the slowest rank; ratio = ours / torch;
  * bubble: 1 - (time in actions) / (step span), from our recorder's events of every rank, mean
    over ranks, median over steps -- against theory (P-1)/(m+P-1), (P-1)/(v*m+P-1) interleaved;
  * peak activation MiB per rank (stage): the recorder's bytes saved for backward, and the peak
    number of in-flight micro-batch chunks.
JSON: benchmarks/results/pipeline.json (--out), with the last step's events per schedule
(``scripts/pipeline_timeline.py`` draws them).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from multiproc import run_ranks

from distlib.parallel.pipeline import executor, schedule
from distlib.parallel.pipeline.recorder import Recorder, bubble, theory

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))


def chunks_for(rank: int, P: int, v: int, shape: dict) -> list[nn.Module]:
    """This rank's chunks of the one stack every variant starts from (seed 0)."""
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(shape["d"], shape["heads"], 4 * shape["d"], dropout=0.0, batch_first=True)
        for _ in range(shape["layers"])
    ]
    S = P * v
    per = len(layers) // S
    stages = [nn.Sequential(*layers[s * per : (s + 1) * per]) for s in range(S)]
    return [stages[schedule.stage_of(rank, c, P)] for c in range(v)]


def _torch_schedule(name, chunks, rank, P, v, m, group):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    stages = [
        PipelineStage(c, schedule.stage_of(rank, i, P), P * v, torch.device("cpu"), group=group)
        for i, c in enumerate(chunks)
    ]
    loss = nn.MSELoss()
    if name == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss)
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stages[0], n_microbatches=m, loss_fn=loss)


def worker(comm, P: int, m: int, steps: int, rounds: int, shape: dict) -> dict:
    torch.set_num_threads(1)
    rank, b, T, d = comm.rank, shape["micro"], shape["tokens"], shape["d"]
    g = torch.Generator().manual_seed(1)
    xs, ts = torch.randn(m, b, T, d, generator=g), torch.randn(m, b, T, d, generator=g)
    variants = {}
    for name, v in SCHEDULES:
        ours = chunks_for(rank, P, v, shape)
        theirs = copy.deepcopy(ours)
        plan = schedule.build(name, P, m, v)
        variants[("ours", name)] = (ours, plan, v)
        variants[("torch", name)] = (theirs, _torch_schedule(name, theirs, rank, P, v, m, None), v)
    out = {
        f"{who}/{name}": dict(seconds=[], events=[], peak_bytes=0, peak_in_flight=0) for who, name in variants
    }
    order = list(variants)
    for step in range(rounds * steps + 1):  # step 0 warms up every variant
        order = order[1:] + order[:1]
        for who, name in order:
            chunks, plan, v = variants[(who, name)]
            for c in chunks:
                c.zero_grad(set_to_none=True)
            rec = Recorder(rank)
            dist.barrier()
            t0 = time.perf_counter()
            if who == "ours":
                executor.run(
                    plan,
                    chunks,
                    comm,
                    feed=lambda i: xs[i],
                    loss_fn=lambda i, y: nn.functional.mse_loss(y, ts[i]),
                    act_shape=(b, T, d),
                    act_dtype=torch.float32,
                    device="cpu",
                    recorder=rec,
                )
            else:
                has_first = any(schedule.stage_of(rank, c, P) == 0 for c in range(v))
                has_last = any(schedule.stage_of(rank, c, P) == P * v - 1 for c in range(v))
                kwargs = {"target": ts.flatten(0, 1), "losses": []} if has_last else {}
                plan.step(*([xs.flatten(0, 1)] if has_first else []), **kwargs)
            seconds = time.perf_counter() - t0
            if rank == 0 and step % steps == 0 and (who, name) == order[-1]:
                print(f"  pp={P}: step {step} of {rounds * steps} done", file=sys.stderr, flush=True)
            if step == 0:
                continue
            if step == 1 and who == "torch":  # same chunks, same batch: the same gradients?
                mine = variants[("ours", name)][0]
                out[f"ours/{name}"]["grad_rel_vs_torch"] = max(
                    ((p.grad - q.grad).norm() / q.grad.norm()).item()
                    for a, c in zip(mine, chunks)
                    for p, q in zip(a.parameters(), c.parameters())
                )
            row = out[f"{who}/{name}"]
            row["seconds"].append(seconds)
            if who == "ours":
                row["events"].append(rec.events)
                row["peak_bytes"], row["peak_in_flight"] = rec.peak_bytes, rec.peak_in_flight
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pp", type=int, nargs="+", default=[2])
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step (m)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=128, help="hidden size (4 heads, feed-forward 4d)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "pipeline.json"))
    args = ap.parse_args()
    shape = dict(d=args.d, heads=4, layers=args.layers, micro=4, tokens=args.tokens)
    if args.quick:
        shape.update(d=32, tokens=16)
        args.steps, args.rounds = 2, 1
    results = {"shape": shape, "m": args.micro, "steps": args.steps, "rounds": args.rounds, "runs": []}
    print(f"TransformerEncoderLayer stack: {shape}, m={args.micro}, {args.steps * args.rounds} steps")
    print(
        f"{'pp':>3} {'schedule':<12} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>10} {'bubble':>7} "
        f"{'theory':>7} {'in flight/rank':>15} {'peak act MiB/rank':>20}"
    )
    for P in args.pp:
        ranks = run_ranks(worker, P, P, args.micro, args.steps, args.rounds, shape, timeout_s=1800)
        n = len(ranks[0]["ours/gpipe"]["seconds"])
        for name, v in SCHEDULES:
            ours = [max(r[f"ours/{name}"]["seconds"][i] for r in ranks) for i in range(n)]
            theirs = [max(r[f"torch/{name}"]["seconds"][i] for r in ranks) for i in range(n)]
            steps = [[e for r in ranks for e in r[f"ours/{name}"]["events"][i]] for i in range(n)]
            measured = statistics.median(statistics.mean(bubble(ev).values()) for ev in steps)
            events = steps[-1]
            row = dict(
                pp=P,
                schedule=name,
                v=v,
                m=args.micro,
                ours_ms=1000 * statistics.median(ours),
                torch_ms=1000 * statistics.median(theirs),
                bubble=measured,
                theory=theory(name, P, args.micro, v),
                peak_in_flight=[r[f"ours/{name}"]["peak_in_flight"] for r in ranks],
                peak_act_mib=[r[f"ours/{name}"]["peak_bytes"] / 2**20 for r in ranks],
                grad_rel_vs_torch=max(r[f"ours/{name}"]["grad_rel_vs_torch"] for r in ranks),
                events=events,
            )
            row["ratio"] = row["ours_ms"] / row["torch_ms"]
            results["runs"].append(row)
            print(
                f"{P:>3} {name + (f' v={v}' if v > 1 else ''):<12} "
                f"{row['ours_ms']:>9.1f} {row['torch_ms']:>9.1f} "
                f"{row['ratio']:>10.2f} {measured:>7.3f} {row['theory']:>7.3f} "
                f"{','.join(map(str, row['peak_in_flight'])):>15} "
                f"{','.join(f'{x:.1f}' for x in row['peak_act_mib']):>20} "
                f"{row['grad_rel_vs_torch']:>13.1e}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out} (draw: python scripts/pipeline_timeline.py {out})")


if __name__ == "__main__":
    main()
