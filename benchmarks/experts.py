"""A mixture of experts measured: an MoE step against a dense model with the same active
parameters, expert parallelism at ep 1, 2 and 4 over 4 gloo ranks, and the all-to-all it rides on
(uneven, routed splits) against gloo's ``all_to_all_single``, in the same run.

    .venv/bin/python benchmarks/experts.py            # ~1 min on 2 cores
    .venv/bin/python benchmarks/experts.py --quick    # 3 timed steps: ~20 s

Models: Mixtral (``model.family=mixtral``) of dim 64, 2 blocks, 8 experts of width 128, top-2, and
the Llama that is its dense twin: one MLP of width top_k x 128 = 256, so a token meets the same
number of MLP weights (the active parameters; the router's 64 x 8 per block aside). Built from
seed 0 on every rank; 4 sequences of 64 tokens per rank and step.

* **moe vs dense** (one rank): forward + backward + AdamW (ZeRO stage 0) ms, median over the
  timed steps, variants interleaved; ``ratio`` = moe ms / dense ms (the dispatch's sort, gathers
  and per-expert matmuls against one matmul pair).
* **ep** (4 ranks, data parallel over all four, the expert group of ep ranks): the same step with
  the experts split over ep ranks (``families.hold_experts_``, ZeRO over the dense and expert
  groups as tests/test_expert_parallel.py); ms of the slowest rank, median; the expert parameters
  each rank holds; the all-to-all bytes each rank sent per step (``CommStats``); ``loss vs ep1`` the
  ranks' mean loss after the timed steps against ep 1's. ``ep4 torch``: ep 4 on a Comm that runs
  torch's ``all_to_all_single`` (``dist.collectives=torch``; its bytes are not counted: ``-``), and
  ``torch_ms_over_ours`` = its ms / ep 4's (> 1: ours faster).
* **all-to-all, routed splits**: rows of width 64 (float32) cut by the counts of a top-2 routing
  over 8 experts in 4 blocks of 2 (skewed: the router favours low expert ids), counts known, our
  ``direct`` and ``pairwise`` over gloo's pairs and ours read from the shared-memory ``board``
  (what training on one host runs) against ``all_to_all_single``, each receiving into a tensor
  allocated once; ratio = torch ms / ours.

* **balance** (one rank, the real trainer, ``model=mixtral_tiny`` and ``model=deepseek_v3_tiny``,
  each at ``train.grad_accum=4``): the trainer's own step time (``step_time_s``, median over the
  timed steps of two rounds, variants alternated) with ``model.balance=aux`` (the whole step's
  load-balancing loss: one forward without gradients counts the step's routing first) against
  ``bias`` (no loss, no counting forward: distlib/app/model/bias_balance.py); ``aux_over_bias`` =
  aux ms / bias ms, the counting forward's cost; the last step's loss of each.

JSON: benchmarks/results/experts.json (--out).
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
from dataclasses import replace
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import collectives as coll_bench  # benchmarks/collectives.py: the same interleaved timing
import torch
import torch.distributed as dist
from multiproc import run_ranks

from distlib.app.config.groups import OptimizerConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.model import families
from distlib.comm import collectives as C
from distlib.comm import local
from distlib.comm.layout import Layout
from distlib.comm.mesh import build_mesh
from distlib.parallel.expert_parallel import expert_grad_scale
from distlib.parallel.zero import ParamGroup, ZeroOptimizer, make_optimizer

MOE = ModelConfig(
    family="mixtral", vocab_size=64, seq_len=64, dim=64, n_heads=4, n_layers=2, mlp_hidden=128, n_experts=8
)
DENSE = replace(MOE, family="llama", mlp_hidden=MOE.top_k * MOE.mlp_hidden)  # MoE keys at defaults
BATCH = 4  # sequences per rank and step
ADAMW = OptimizerConfig(lr=1e-3).adamw


def _batch(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    tokens = torch.randint(0, MOE.vocab_size, (BATCH, MOE.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _setup(comm, cfg: ModelConfig, ep: int, collectives: str = "ours"):
    """(model, optimizer, stats of the expert group's Comm or None) on these ranks."""
    mesh = build_mesh(comm, Layout.of(comm.size, ep=ep))
    model = families.build(cfg, seed=0)
    families.join_batch_(model, mesh.batch)
    if ep == 1:
        return model, make_optimizer(model, mesh.batch, 0, ADAMW, 1.0), None
    group = mesh.ep.instrumented(False, collectives)
    experts = families.hold_experts_(model, group)
    dense = tuple(n for n, _ in model.named_parameters() if n not in experts)
    groups = [
        ParamGroup("dense", dense, mesh.batch),
        ParamGroup("experts", experts, mesh.expert_dp, (mesh.ep,), expert_grad_scale(mesh.ep)),
    ]
    return model, ZeroOptimizer(model, groups, 0, ADAMW, 1.0), group.stats


def _step(model, opt, batch) -> float:
    loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _timed(variants: dict, batch, steps: int) -> dict[str, list[float]]:
    for model, opt, *_ in variants.values():  # warm-up
        _step(model, opt, batch)
    names = list(variants)
    seconds = {k: [] for k in names}
    for i in range(steps):
        for k in names[i % len(names) :] + names[: i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            _step(*variants[k][:2], batch)
            seconds[k].append(time.perf_counter() - t0)
    return seconds


def one_rank(comm, steps: int) -> dict:
    variants = {"moe": _setup(comm, MOE, 1), "dense": _setup(comm, DENSE, 1)}
    out = {"seconds": _timed(variants, _batch(0), steps)}
    out["params"] = {k: sum(p.numel() for p in v[0].parameters()) for k, v in variants.items()}
    return out


def expert_ranks(comm, steps: int, eps: list[int]) -> dict:
    variants = {f"ep{ep}": _setup(comm, MOE, ep) for ep in eps}
    variants[f"ep{eps[-1]} torch"] = _setup(comm, MOE, eps[-1], "torch")
    batch = _batch(comm.rank)
    for _, _, stats in variants.values():
        if stats is not None:
            stats.bytes_sent["all_to_all"] = 0
    seconds = _timed(variants, batch, steps)
    out = {"seconds": seconds, "losses": {}, "expert_params": {}, "a2a_bytes_per_step": {}}
    for name, (model, _, stats) in variants.items():
        with torch.no_grad():
            loss = model(*batch)
        out["losses"][name] = float(C.all_reduce(loss.detach().clone(), comm, op="sum")) / comm.size
        out["expert_params"][name] = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        # (torch's all_to_all_single sends outside our counters: no bytes for that variant)
        sent = stats.bytes_sent["all_to_all"] / (steps + 1) if stats else 0
        out["a2a_bytes_per_step"][name] = None if name.endswith("torch") else sent
    out["all_to_all"] = _routed_all_to_all(comm)
    return out


def _routed_all_to_all(comm) -> list[dict]:
    """Our all-to-all and torch's on the splits one skewed routing gives (module docstring)."""
    n, per_rank_tokens, width = comm.size, BATCH * MOE.seq_len, MOE.dim
    g = torch.Generator().manual_seed(comm.rank)
    skew = torch.linspace(1.0, 0.0, MOE.n_experts)
    ids = (torch.randn(per_rank_tokens, MOE.n_experts, generator=g) + skew).topk(MOE.top_k).indices
    per_expert = torch.bincount(ids.flatten(), minlength=MOE.n_experts)
    send = per_expert.view(n, -1).sum(dim=1).tolist()
    recv_t = torch.zeros(n * n, dtype=torch.int64)
    C.all_gather(recv_t, torch.tensor(send), comm)
    recv = recv_t.view(n, n)[:, comm.rank].tolist()
    rows = torch.randn(sum(send), width, generator=g)
    got, into = torch.empty(sum(recv), width), torch.empty(sum(recv), width)  # each allocated once
    fns = {
        a: (lambda a=a: C.all_to_all(rows, comm, send, recv, algo=a, out=into))
        for a in ("direct", "pairwise")
    }
    board = local.attach(comm, None, 600.0)  # forked on one host: the shared-memory board training uses
    fns["board"] = lambda: C.all_to_all(rows, board, send, recv, out=into)
    fns["torch"] = lambda: dist.all_to_all_single(got, rows, recv, send)
    times = coll_bench._time_interleaved(fns, coll_bench._iters(rows.numel() * 4))
    return [{"bytes": rows.numel() * 4, "send": send, "recv": recv, **times}]


def balance_steps(comm, steps: int, preset: str) -> dict:
    """The trainer's step times (s) and last loss of ``model=preset`` at model.balance=aux and
    bias, two rounds each."""
    from trainrun import compose_tree

    from distlib.app.config.run import RunConfig
    from distlib.app.trainer import Trainer

    base = [f"model={preset}", "train.grad_accum=4", "dist.world_size=1", f"train.steps={steps + 2}"]
    base += ["checkpoint.every_steps=0", "checkpoint.verify_resume=false", "metrics.progress_every=0"]
    base += ["optimizer.warmup_steps=0"]  # (deepseek_v3_tiny's 10 exceed --quick's steps; time is the same)
    out = {"aux": [], "bias": []}
    losses = {}
    for _ in range(2):
        for name in out:
            tree = compose_tree([*base, f"model.balance={name}"])
            with tempfile.TemporaryDirectory() as run_dir, open(os.devnull, "w") as quiet:
                with contextlib.redirect_stdout(quiet):
                    Trainer(RunConfig.from_dict(tree), comm, Path(run_dir)).run()
                records = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
            timed = [r for r in records if r["type"] == "step"][2:]  # two warm-up steps
            out[name] += [r["step_time_s"] for r in timed]
            losses[name] = timed[-1]["loss"]
    return {"seconds": out, "losses": losses}


def _balance(preset: str, steps: int) -> dict:
    counted = run_ranks(balance_steps, 1, steps, preset, timeout_s=600)[0]
    aux_ms, bias_ms = (statistics.median(counted["seconds"][k]) * 1e3 for k in ("aux", "bias"))
    return dict(
        model=preset, aux_ms=aux_ms, bias_ms=bias_ms, aux_over_bias=aux_ms / bias_ms, losses=counted["losses"]
    )


def _slowest(per_rank: list[list[float]]) -> float:
    return statistics.median(max(ts) * 1e3 for ts in zip(*per_rank))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 timed steps")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "experts.json"))
    args = ap.parse_args()
    steps = 3 if args.quick else args.steps
    torch.set_num_threads(1)  # one thread per rank, as every benchmark here
    load_before = os.getloadavg()[0]
    single = run_ranks(one_rank, 1, steps, timeout_s=600)[0]
    eps = [1, 2, 4]
    ranks = run_ranks(expert_ranks, 4, steps, eps, timeout_s=600)

    moe_ms = statistics.median(single["seconds"]["moe"]) * 1e3
    dense_ms = statistics.median(single["seconds"]["dense"]) * 1e3
    compare = dict(moe_ms=moe_ms, dense_ms=dense_ms, ratio=moe_ms / dense_ms, params=single["params"])
    layouts = []
    for name in ranks[0]["seconds"]:
        ms = _slowest([r["seconds"][name] for r in ranks])
        layouts.append(
            dict(
                name=name,
                ms=ms,
                expert_params_per_rank=ranks[0]["expert_params"][name],
                a2a_bytes_per_step=None
                if name.endswith("torch")
                else max(r["a2a_bytes_per_step"][name] for r in ranks),
                loss=ranks[0]["losses"][name],
                loss_abs_vs_ep1=abs(ranks[0]["losses"][name] - ranks[0]["losses"]["ep1"]),
            )
        )
    by_name = {row["name"]: row for row in layouts}
    torch_row = by_name[f"ep{eps[-1]} torch"]
    torch_row["torch_ms_over_ours"] = torch_row["ms"] / by_name[f"ep{eps[-1]}"]["ms"]
    a2a = []
    for i, row in enumerate(ranks[0]["all_to_all"]):
        names = ("direct", "pairwise", "board", "torch")
        cell = {k: _slowest([r["all_to_all"][i][k] for r in ranks]) for k in names}
        a2a.append(
            dict(
                bytes_rank0=row["bytes"],
                send_rank0=row["send"],
                **{f"{k}_ms": v for k, v in cell.items()},
                ratio_direct=cell["torch"] / cell["direct"],
                ratio_pairwise=cell["torch"] / cell["pairwise"],
                ratio_board=cell["torch"] / cell["board"],
            )
        )
    balance = [_balance(preset, steps) for preset in ("mixtral_tiny", "deepseek_v3_tiny")]
    _print(compare, layouts, a2a)
    print("\nbalance, one rank, train.grad_accum=4: the trainer's step ms (median)")
    print(f"{'model':<18}{'aux':>9}{'bias':>9}{'aux/bias':>10}")
    for b in balance:
        print(f"{b['model']:<18}{b['aux_ms']:>9.1f}{b['bias_ms']:>9.1f}{b['aux_over_bias']:>10.2f}")
    load_after = os.getloadavg()[0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    record = dict(quick=args.quick, torch=torch.__version__, cores=os.cpu_count())
    record.update(loadavg_1min=[load_before, load_after], moe=vars_of(MOE), dense=vars_of(DENSE))
    record.update(batch_per_rank=BATCH, steps=steps, moe_vs_dense=compare, layouts=layouts, all_to_all=a2a)
    record.update(balance=balance)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"1-min load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} cores")
    print(f"wrote {args.out}")


def vars_of(cfg: ModelConfig) -> dict:
    keys = (
        "family",
        "vocab_size",
        "dim",
        "n_layers",
        "n_heads",
        "seq_len",
        "mlp_hidden",
        "n_experts",
        "top_k",
    )
    return {k: getattr(cfg, k) for k in keys}


def _print(compare: dict, layouts: list[dict], a2a: list[dict]) -> None:
    p = compare["params"]
    print(f"one rank, fwd + bwd + AdamW ms (median); params: moe {p['moe']:,}, dense {p['dense']:,}")
    print(f"{'moe':>9}{'dense':>9}{'moe/dense':>11}")
    print(f"{compare['moe_ms']:>9.1f}{compare['dense_ms']:>9.1f}{compare['ratio']:>11.2f}")
    print("\n4 ranks (dp 4), the experts over ep ranks: ms of the slowest rank (median)")
    print(f"{'layout':<11}{'ms':>8}{'expert params/rank':>20}{'a2a KiB/step':>14}{'loss vs ep1':>13}")
    for r in layouts:
        sent = "-" if r["a2a_bytes_per_step"] is None else f"{r['a2a_bytes_per_step'] / 1024:.1f}"
        print(
            f"{r['name']:<11}{r['ms']:>8.1f}{r['expert_params_per_rank']:>20,}{sent:>14}"
            f"{r['loss_abs_vs_ep1']:>13.1e}"
        )
    t = next(r for r in layouts if "torch_ms_over_ours" in r)
    print(f"{t['name']} ms / {t['name'].split()[0]} ms = {t['torch_ms_over_ours']:.2f} (> 1: ours faster)")
    print("\nall-to-all, routed (uneven) splits: ms (median of the slowest rank); ratio = torch ms / ours")
    head = f"{'KiB r0':>8}{'direct':>9}{'pairwise':>10}{'board':>9}{'torch':>9}"
    print(f"{head}{'direct':>9}{'pairwise':>10}{'board':>9}")
    for r in a2a:
        ms = f"{r['direct_ms']:>9.3f}{r['pairwise_ms']:>10.3f}{r['board_ms']:>9.3f}{r['torch_ms']:>9.3f}"
        ratios = f"{r['ratio_direct']:>9.2f}{r['ratio_pairwise']:>10.2f}{r['ratio_board']:>9.2f}"
        print(f"{r['bytes_rank0'] / 1024:>8.0f}{ms}{ratios}")


if __name__ == "__main__":
    main()
