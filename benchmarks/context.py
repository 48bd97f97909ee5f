"""Context parallelism (``dist.cp``) measured: activation memory per rank at cp 1, 2 and 4, the
longest sequence a per-rank budget holds, ring vs all-to-all step time on 2 and 4 gloo ranks, and
the all-to-all the Ulysses route rides on against gloo's ``all_to_all_single``, in the same run.

    .venv/bin/python benchmarks/context.py                  # seq 128 .. 2048, ~1 min on 2 cores
    .venv/bin/python benchmarks/context.py --quick          # seq 64, 128, 256, 2 steps: ~15 s
    .venv/bin/python benchmarks/context.py --seqs 256 4096 --budget-mib 1024

Model: Llama (``model.family=llama``), dim 64, 4 heads, 2 blocks, vocab 64, one sequence per step,
built from seed 0 on every rank; rank r of cp holds chunks r and 2cp-1-r of it
(``batches.held_tokens``, the trainer's split) and its attention reaches the others' tokens by
``ContextSplit`` (the model built with it, ``strategies.Strategies``, as the trainer builds it). A
step is forward + backward of the model: no optimizer and no gradient all-reduce (over dp x cp,
the same bytes for both routes).

* **memory**: the bytes autograd keeps from one forward for its backward on each rank
  (``ActivationMeter``, the trainer's ``activation_bytes``; parameters and buffers excluded), the
  largest rank's. Exact, so load-proof. ``loss vs cp1``: the ranks' mean loss against one rank's.
* **longest seq**: a least-squares fit bytes = a + b S + c S^2 per (cp, route) over the measured
  lengths (every saved tensor is a multiple of S or of S^2, so the fit is exact: ``fit err``),
  solved for ``--budget-mib`` per rank and rounded down to a multiple of 2 cp. ``+ masks``: the same
  with every block's causal-mask buffer added (S^2 bytes per block, held by every rank whatever cp).
* **step**: median over ``--steps`` rounds of the slowest rank's forward + backward, the variants
  rotated each round after a barrier (outside load hits all alike): ``alltoall`` (our all-to-all),
  ``ring``, and ``alltoall`` on a Comm running torch's ``all_to_all_single`` (``dist.collectives=torch``);
  ``ring speed-up`` = alltoall ms / ring ms, ``vs torch coll`` = torch-coll ms / ours (> 1: ours faster).
* **all-to-all**: N equal pieces, counts given (as Ulysses calls it), ``direct`` and ``pairwise``
  against ``all_to_all_single``; ratio = torch ms / ours (benchmarks/collectives.py's timing).
* **key/value bytes** (exact counts): what rank 0 sends on the cp group in one step at the longest
  S, per route: the Llama with its K/V repeated to the 4 query heads (4 key/value heads of 16),
  grouped (1 key/value head), and DeepSeek-V3's latent attention of the same width and heads
  (``MLA``: heads of 16 + 8 rotary, values of 16, a latent of 32 + 8), whose ring sends the latent.

JSON: benchmarks/results/context.json (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import collectives as coll_bench  # benchmarks/collectives.py: the same all-to-all timing
import numpy as np
import torch
import torch.distributed as dist
from context_tables import ONE, print_kv, print_tables
from multiproc import run_ranks

from distlib.app.config.model_group import ModelConfig
from distlib.app.data.batches import held_tokens
from distlib.app.model import families
from distlib.app.model.attention import ContextSplit
from distlib.app.model.strategies import LOCAL, Strategies
from distlib.app.observe.activations import ActivationMeter

SHAPE = dict(family="llama", vocab_size=64, dim=64, n_heads=4, n_layers=2)
BATCH = 1  # sequences per step: one long sequence is what context parallelism is for
ROUTES = {"alltoall": ("alltoall", "ours"), "ring": ("ring", "ours"), "alltoall torch": ("alltoall", "torch")}


def _model(seq: int, comm, route: str | None):
    if route is None:
        return families.build(ModelConfig(seq_len=seq, **SHAPE), 0, LOCAL)
    impl, collectives = ROUTES[route]
    context = ContextSplit(comm.instrumented(False, collectives), impl)
    return families.build(ModelConfig(seq_len=seq, **SHAPE), 0, Strategies(context=context))


def _batch(seq: int, comm):
    tokens = torch.randint(
        0, SHAPE["vocab_size"], (BATCH, seq + 1), generator=torch.Generator().manual_seed(1)
    )
    return held_tokens(tokens[:, :-1], tokens[:, 1:], comm if comm.size > 1 else None, "cpu")


def _step(model, meter: ActivationMeter, batch) -> float:
    model.zero_grad(set_to_none=True)
    with meter.measure(model):
        loss = model(*batch)
    loss.backward()
    return float(loss.detach())


# Grouped-query attention's key/value traffic: GQA_KV key/value heads for SHAPE's query heads,
# against as many as query heads (the shapes K/V had when they were repeated before moving).
GQA_KV = 1
# Latent attention of SHAPE's width and heads (one dense block, one MoE block: no cp traffic)
MLA = SHAPE | dict(family="deepseek_v3", kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16)


def kv_bytes(comm, seq: int) -> dict:
    """Per route of ours: the bytes this rank sends on the cp group in one step (forward + backward),
    with K/V grouped (``GQA_KV`` heads) and with them repeated to the query heads."""
    out = {}
    for route in ("alltoall", "ring"):
        for name, kv in (("grouped", GQA_KV), ("repeated", SHAPE["n_heads"])):
            cp = comm.instrumented(False)
            split = Strategies(context=ContextSplit(cp, route))
            model = families.build(ModelConfig(seq_len=seq, n_kv_heads=kv, **SHAPE), 0, split)
            _step(model, ActivationMeter(), _batch(seq, comm))
            out.setdefault(route, {})[name] = sum(cp.stats.bytes_sent.values())
        cp = comm.instrumented(False)
        model = families.build(
            ModelConfig(seq_len=seq, **MLA), 0, Strategies(context=ContextSplit(cp, route))
        )
        _step(model, ActivationMeter(), _batch(seq, comm))
        out[route]["latent"] = sum(cp.stats.bytes_sent.values())
    return out


def worker(comm, seqs: list[int], steps: int, a2a_sizes: list[int]) -> dict:
    """On every rank of one cp group (the whole world): per sequence length, each route's
    activation bytes and loss from a warm-up step, then ``steps`` timed rounds."""
    routes = list(ROUTES) if comm.size > 1 else [None]
    out = {"seqs": {}, "all_to_all": [], "kv_bytes": kv_bytes(comm, seqs[-1]) if comm.size > 1 else {}}
    for seq in seqs:
        batch = _batch(seq, comm)
        models = {r: _model(seq, comm, r) for r in routes}
        meters = {r: ActivationMeter() for r in routes}
        row = {
            r or ONE: {"loss": _step(models[r], meters[r], batch), "bytes": meters[r].peak} for r in routes
        }
        for r in routes:
            row[r or ONE].update(seconds=[], cpu=[])
        for i in range(steps):
            k = i % len(routes)
            for r in routes[k:] + routes[:k]:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                _step(models[r], meters[r], batch)
                row[r or ONE]["seconds"].append(time.perf_counter() - t0)
                row[r or ONE]["cpu"].append(time.process_time() - c0)  # gloo's threads included
        out["seqs"][seq] = row
    for nbytes in a2a_sizes if comm.size > 1 else []:
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(comm.rank))
        fns = {a: coll_bench._callables("all_to_all", x, comm, a)[0] for a in ("direct", "pairwise")}
        fns["torch"] = coll_bench._callables("all_to_all", x, comm, None)[1]
        out["all_to_all"].append(
            {"bytes": nbytes, **coll_bench._time_interleaved(fns, coll_bench._iters(nbytes))}
        )
    return out


def fit(seqs: list[int], nbytes: list[int]) -> tuple[list[float], float]:
    """(a, b, c) of bytes = a + b S + c S^2 by least squares, and the largest relative residual."""
    s = np.array(seqs, dtype=np.float64)
    coef = np.linalg.lstsq(np.stack([s**0, s, s**2], 1), np.array(nbytes, dtype=np.float64), rcond=None)[0]
    err = max(abs(np.polyval(coef[::-1], x) - y) / y for x, y in zip(s, nbytes))
    return [float(c) for c in coef], float(err)


def longest(coef: list[float], budget: float, multiple: int) -> int:
    """The largest multiple of ``multiple`` whose fitted bytes stay within ``budget``."""
    a, b, c = coef
    c = max(c, 0.0)  # the ring's S^2 term fits to +-1e-13: rounding, not a negative byte count
    # the positive root of c s^2 + b s + a = budget, in the form that stays exact as c -> 0
    s = 2 * (budget - a) / (b + math.sqrt(b * b + 4 * c * (budget - a)))
    s = int(s) // multiple * multiple
    while s > 0 and a + b * s + c * s * s > budget:  # rounding at the boundary
        s -= multiple
    return s


def _slowest_median(per_rank: list[list[float]]) -> tuple[float, float, float]:
    slowest = [max(ts) * 1e3 for ts in zip(*per_rank)]
    return statistics.median(slowest), min(slowest), max(slowest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="seq 64, 128, 256, 2 timed steps, one all-to-all size"
    )
    ap.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (multiples of 8)")
    ap.add_argument("--cps", type=int, nargs="+", default=[2, 4], help="context-parallel degrees besides 1")
    ap.add_argument("--steps", type=int, default=7, help="timed rounds per sequence length")
    ap.add_argument("--budget-mib", type=float, default=256.0, help="activation memory per rank")
    ap.add_argument("--a2a-sizes", type=int, nargs="+", help="all-to-all bytes per rank (multiples of 16)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "context.json"))
    args = ap.parse_args()
    seqs = sorted(set(args.seqs or ([64, 128, 256] if args.quick else [128, 256, 512, 1024, 2048])))
    steps = 2 if args.quick else args.steps
    if len(seqs) < 3 or any(s % (2 * cp) for s in seqs for cp in args.cps):
        ap.error(f"--seqs {seqs}: at least 3 lengths (the fit has 3 terms), each a multiple of 2 x every cp")
    a2a_sizes = args.a2a_sizes or ([16 << 10] if args.quick else [16 << 10, 256 << 10, 4 << 20])
    budget = args.budget_mib * 2**20
    torch.set_num_threads(1)  # one thread per rank, as every benchmark here
    load_before = os.getloadavg()[0]
    ranks = {cp: run_ranks(worker, cp, seqs, steps, a2a_sizes, timeout_s=600) for cp in [1, *args.cps]}

    memory, steps_out, fits, a2a = [], [], [], []
    one = {seq: ranks[1][0]["seqs"][seq][ONE] for seq in seqs}
    for cp, per_rank in ranks.items():
        for route in [ONE] if cp == 1 else list(ROUTES):
            by_seq = []
            for seq in seqs:
                got = [r["seqs"][seq][route] for r in per_rank]
                loss = sum(g["loss"] for g in got) / cp  # equal tokens per rank: the sequence's mean
                ms, lo, hi = _slowest_median([g["seconds"] for g in got])
                cpu = statistics.median(sum(c) * 1e3 for c in zip(*(g["cpu"] for g in got)))
                by_seq.append(max(g["bytes"] for g in got))
                memory.append(
                    dict(
                        cp=cp,
                        route=route,
                        seq_len=seq,
                        activation_bytes=by_seq[-1],
                        activation_bytes_per_rank=[g["bytes"] for g in got],
                        mask_buffer_bytes=SHAPE["n_layers"] * seq * seq,
                        loss=loss,
                        loss_rel_vs_cp1=abs(loss - one[seq]["loss"]) / one[seq]["loss"],
                    )
                )
                steps_out.append(
                    dict(cp=cp, route=route, seq_len=seq, ms=ms, ms_min=lo, ms_max=hi, cpu_ms=cpu)
                )
            if route == "alltoall torch":
                continue  # the same model and tensors as alltoall: the same bytes
            coef, err = fit(seqs, by_seq)
            masked = [coef[0], coef[1], coef[2] + SHAPE["n_layers"]]
            fits.append(
                dict(
                    cp=cp,
                    route=route,
                    coef=coef,
                    max_rel_residual=err,
                    longest_seq=longest(coef, budget, 2 * cp),
                    longest_seq_with_masks=longest(masked, budget, 2 * cp),
                )
            )
        for i, nbytes in enumerate(a2a_sizes if cp > 1 else []):
            row = dict(world=cp, bytes=nbytes)
            for k in ("direct", "pairwise", "torch"):
                row[k + "_ms"] = _slowest_median([r["all_to_all"][i][k] for r in per_rank])[0]
            row["ratio_direct"] = row["torch_ms"] / row["direct_ms"]
            row["ratio_pairwise"] = row["torch_ms"] / row["pairwise_ms"]
            a2a.append(row)
    kv = [
        dict(cp=cp, route=route, seq_len=seqs[-1], n_kv_heads=GQA_KV, **sent)
        | {"ratio": sent["grouped"] / sent["repeated"], "latent_ratio": sent["latent"] / sent["repeated"]}
        for cp, per_rank in ranks.items()
        for route, sent in per_rank[0]["kv_bytes"].items()
    ]
    ms = {(s["cp"], s["route"], s["seq_len"]): s["ms"] for s in steps_out}
    for s in steps_out:
        if s["cp"] > 1 and s["route"] == "ring":
            s["ring_speedup"] = ms[s["cp"], "alltoall", s["seq_len"]] / s["ms"]
        if s["route"] == "alltoall":
            s["ratio_vs_torch_collectives"] = ms[s["cp"], "alltoall torch", s["seq_len"]] / s["ms"]

    print_tables(f"Llama {SHAPE}, batch {BATCH}", memory, fits, steps_out, a2a, seqs, args.budget_mib)
    print_kv(kv, SHAPE["n_heads"], GQA_KV)
    load_after = os.getloadavg()[0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            dict(
                quick=args.quick,
                torch=torch.__version__,
                cores=os.cpu_count(),
                loadavg_1min=[load_before, load_after],
                model=SHAPE,
                latent_model=MLA,
                batch=BATCH,
                seqs=seqs,
                steps=steps,
                budget_bytes=budget,
                memory=memory,
                fits=fits,
                steps_ms=steps_out,
                all_to_all=a2a,
                kv_bytes=kv,
            ),
            f,
            indent=1,
        )
    print(f"1-min load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} cores")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
