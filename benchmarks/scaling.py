"""Data-parallel scaling of the medium MiniGPT from 1 to 2 ranks (this machine has 2 cores).

    .venv/bin/python benchmarks/scaling.py            # ~1 min
    .venv/bin/python benchmarks/scaling.py --quick    # ~30 s

Weak scaling, batch B = 8 sequences of 128 tokens per rank:
  t1 = ms per step of one process training on B sequences (no communication at all),
  t2 = ms per step of two ranks, each on its own B sequences (global batch 2B), synchronised;
  tokens/s(N) = N * B * seq_len / tN, and
  efficiency = tokens/s(2) / (2 * tokens/s(1)) = t1 / t2   (1.0 = perfect; goal >= 0.85).

Both are measured inside one pair of forked ranks, interleaved step by step so background load
hits them alike: for a 1-rank step rank 0 trains a separate single-process copy while rank 1
waits on a barrier (idle, as if it did not exist); for a 2-rank step both train the
data-parallel copy. Done for our ZeRO stage 1 and stage 0 (vs a world-size-1 ZeroOptimizer, which
sends nothing) and, as the reference, torch DDP (vs plain torch with torch.optim.AdamW).
JSON: benchmarks/results/scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step as S  # benchmarks/step.py: models, variants, data
import torch
import torch.distributed as dist
from multiproc import run_ranks

from distlib.app.model.minigpt import build_model
from distlib.comm.group import Comm

MODEL = "medium"
GOAL = 0.85


def _single_process_torch(cfg) -> S.Variant:
    model = build_model(cfg, S.MODEL_SEED)
    opt = S._torch_adamw(model.parameters())
    return S.Variant("torch, 1 process", S._torch_step(model, opt), lambda: S._torch_state_bytes(opt))


def _rank_main(comm: Comm, stages: list[int], steps: int, warmup: int) -> dict:
    cfg, batch = S.MODELS[MODEL]
    alone = Comm(ranks=(comm.peer(0),), rank=0)
    pairs = {
        f"ours stage {s}": (
            S.build_ours(cfg, alone, s) if comm.rank == 0 else None,
            S.build_ours(cfg, comm, s),
        )
        for s in stages
    }
    pairs["torch DDP"] = (_single_process_torch(cfg) if comm.rank == 0 else None, S.build_ddp(cfg, comm))
    one = S.batches_for(cfg, batch, alone, warmup + steps) if comm.rank == 0 else None
    two = S.batches_for(cfg, batch, comm, warmup + steps)
    out = {name: {"t1": [], "t2": []} for name in pairs}
    jobs = [(name, n) for name in pairs for n in (1, 2)]
    for t in range(warmup + steps):
        k = t % len(jobs)
        for name, n in jobs[k:] + jobs[:k]:
            dist.barrier()
            began = time.perf_counter()
            if n == 2:
                pairs[name][1].step(*two[t])
            elif comm.rank == 0:
                pairs[name][0].step(*one[t])
            elapsed = time.perf_counter() - began
            dist.barrier()  # rank 1 idles here while rank 0 runs a 1-rank step
            if t >= warmup and (n == 2 or comm.rank == 0):
                out[name][f"t{n}"].append(elapsed)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--steps", type=int, help="timed steps (default 12, --quick 5)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--out", default=os.path.join(S.ROOT, "benchmarks", "results", "scaling.json"))
    args = ap.parse_args()
    steps = args.steps or (5 if args.quick else 12)
    torch.set_num_threads(1)
    cfg, batch = S.MODELS[MODEL]
    per_rank = run_ranks(_rank_main, 2, args.stages, steps, args.warmup, timeout_s=900)
    rows = []
    for name in per_rank[0]:
        t1 = statistics.median(per_rank[0][name]["t1"])
        t2 = statistics.median(max(a, b) for a, b in zip(per_rank[0][name]["t2"], per_rank[1][name]["t2"]))
        tokens = batch * cfg.seq_len
        rows.append(
            {
                "variant": name,
                "t1_ms": t1 * 1e3,
                "t2_ms": t2 * 1e3,
                "tokens_per_s_1": tokens / t1,
                "tokens_per_s_2": 2 * tokens / t2,
                "efficiency": t1 / t2,
            }
        )
    print(
        f"medium MiniGPT, batch {batch} x {cfg.seq_len} tokens per rank; median of {steps} interleaved steps"
    )
    print(f"{'variant':<14}{'1 rank ms':>10}{'2 ranks ms':>11}{'tok/s 1':>9}{'tok/s 2':>9}{'efficiency':>12}")
    for r in rows:
        print(
            f"{r['variant']:<14}{r['t1_ms']:>10.1f}{r['t2_ms']:>11.1f}{r['tokens_per_s_1']:>9.0f}"
            f"{r['tokens_per_s_2']:>9.0f}{r['efficiency']:>12.2f}"
        )
    ours = rows[0]
    print(
        f"efficiency = tokens/s(2) / (2 tokens/s(1)) = t1/t2; goal >= {GOAL}: "
        f"{'met' if ours['efficiency'] >= GOAL else 'NOT met'} for {ours['variant']}"
    )
    payload = {
        "quick": args.quick,
        "steps": steps,
        "model": MODEL,
        "batch_per_rank": batch,
        "seq_len": cfg.seq_len,
        "cores": os.cpu_count(),
        "goal": GOAL,
        "results": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
