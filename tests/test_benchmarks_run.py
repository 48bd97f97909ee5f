"""The benchmarks still run (they import the library directly, so a refactor can break them
without any other test noticing) and write the JSON benchmarks/README.md and their docstrings
document. Tiny settings: the checks are on what the numbers must satisfy whatever the machine's
speed (the configurations requested, positive finite times, the documented ratios and formulas,
the schedules' in-flight counts, ours agreeing with torch), never on the speeds themselves;
startup.py and scaling.py are left to `make bench` (minutes each); recovery.py (two torchrun jobs)
runs in tests/test_memory_snapshot_e2e.py, which also checks its snapshot run's checkpoint."""

import json
import math
import os
import subprocess
import sys

import pytest
from e2e import ROOT
from forkrun import run_script

from distlib.app.config.model_group import ModelConfig
from distlib.app.config.run import RunConfig
from distlib.app.model import families
from distlib.parallel.context.ulysses import gathering_sends_less

pytestmark = pytest.mark.slow

RUNS = {
    "checkpoint": ["benchmarks/checkpoint.py", "--params", "1e5", "--world-size", "2", "--repeats", "1"],
    # 3 timed iterations, not 100: the checks hold for any number of them (24 -> ~5 CPU-s)
    "collectives": ["benchmarks/collectives.py", "--quick", "--sizes", "1024", "--iters", "3"],
    "context": ["benchmarks/context.py", "--quick"],
    "experts": ["benchmarks/experts.py", "--quick"],
    "pipeline": ["benchmarks/pipeline.py", "--quick"],
    "plan": ["benchmarks/plan.py", "--quick", "--speed-world", "2"],
    "plan_time": ["benchmarks/plan_time.py", "--quick", "--world", "2"],
    "snapshots": ["benchmarks/snapshots.py", "--quick", "--world-size", "2"],
    "token_cache": ["benchmarks/token_cache.py", "--mb", "1"],
    "ring_documents": ["benchmarks/ring_documents.py", "--quick"],
    # scripts/gpu_check.sh's step h (--model gpt2_124m) on the CPU, at the gpt2 preset's small shape
    "gpu_throughput": [
        "benchmarks/gpu_throughput.py",
        "--device",
        "cpu",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--warmup",
        "1",
        "--steps",
        "1",
    ],
    "step": [
        "benchmarks/step.py",
        "--models",
        "tiny",
        "--worlds",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--stages",
        "1",
        "3",
        "--torch",
        "ddp",
    ],
}
LOSS_RTOL = 1e-4  # README: every variant within 1e-4 of DDP's loss (they differ by reduction order)


def _times(*values) -> bool:
    return all(0 < v < math.inf for v in values)


def _params(model: dict) -> int:
    """The parameters of the model a JSON describes, counted from the model itself."""
    return sum(p.numel() for p in families.build(RunConfig.from_dict({"model": model}).model, 0).parameters())


def _check_checkpoint(d, tmp_path):
    assert (d["params"], d["state_bytes"], d["world_size"], d["repeats"]) == (10**5, 12 * 10**5, 2, 1)
    seconds = {r["what"]: r["seconds"] for r in d["rows"]}
    assert {"raw write", "distlib save", "torch DCP save", "distlib load", "torch DCP load"} <= set(seconds)
    assert {"distlib async blocking", "distlib async total", "torch DCP async blocking"} <= set(seconds)
    assert _times(*seconds.values())
    assert seconds["distlib load"] == pytest.approx(seconds["distlib verify"] + seconds["distlib read"])
    for r in d["rows"]:  # MB/s = 12P bytes / seconds; the ratio is raw write's time over the row's
        assert r["mb_per_s"] == pytest.approx(12 * 10**5 / r["seconds"] / 1e6)
        assert r["raw_write_ratio"] == pytest.approx(seconds["raw write"] / r["seconds"])
    assert list(tmp_path.iterdir()) == [tmp_path / "checkpoint.json"], "its temporary files were removed"


def _check_collectives(d, tmp_path):
    ops = ["broadcast", "reduce_scatter", "all_gather", "all_reduce", "all_to_all"]
    rows = d["results"]
    assert sorted((r["op"], r["world"], r["bytes"]) for r in rows) == sorted(
        (op, world, 1024)
        for op in ops
        for world in (2, 4)  # --sizes 1024, the default worlds 2 and 4
    )
    assert d["iters"] == 3
    for r in rows:
        assert _times(r["ours_ms"], r["torch_ms"], r["rings_ms"], r["shm_ms"], r["copy_ms"])
        assert r["ratio"] == pytest.approx(r["torch_ms"] / r["ours_ms"])  # > 1: ours faster
        assert r["shm_ratio"] == pytest.approx(r["torch_ms"] / r["shm_ms"])
        assert r["shm_vs_copy"] == pytest.approx(r["shm_ms"] / r["copy_ms"])


def _check_experts(d, tmp_path):
    moe, dense, c = d["moe"], d["dense"], d["moe_vs_dense"]
    assert dense["mlp_hidden"] == moe["top_k"] * moe["mlp_hidden"], "the dense twin's active MLP weights"
    assert _times(c["moe_ms"], c["dense_ms"]) and c["ratio"] == pytest.approx(c["moe_ms"] / c["dense_ms"])
    assert c["params"] == {"moe": _params(moe), "dense": _params(dense)}
    rows = {r["name"]: r for r in d["layouts"]}
    assert list(rows) == ["ep1", "ep2", "ep4", "ep4 torch"]
    every_expert = moe["n_layers"] * moe["n_experts"] * 3 * moe["dim"] * moe["mlp_hidden"]
    for name, r in rows.items():
        ep = int(name.split()[0].removeprefix("ep"))
        assert _times(r["ms"]) and r["expert_params_per_rank"] * ep == every_expert, name
        assert r["loss_abs_vs_ep1"] <= 1e-5, "every layout trains the same model"
    assert rows["ep1"]["a2a_bytes_per_step"] == 0 and rows["ep4 torch"]["a2a_bytes_per_step"] is None
    assert 0 < rows["ep2"]["a2a_bytes_per_step"] < rows["ep4"]["a2a_bytes_per_step"]
    ratio = rows["ep4 torch"]["torch_ms_over_ours"]
    assert ratio == pytest.approx(rows["ep4 torch"]["ms"] / rows["ep4"]["ms"])
    for a in d["all_to_all"]:
        assert (
            _times(a["direct_ms"], a["pairwise_ms"], a["board_ms"], a["torch_ms"])
            and len(a["send_rank0"]) == 4
        )
        assert a["ratio_direct"] == pytest.approx(a["torch_ms"] / a["direct_ms"])
        assert a["ratio_board"] == pytest.approx(a["torch_ms"] / a["board_ms"])
        assert a["bytes_rank0"] == sum(a["send_rank0"]) * moe["dim"] * 4
    assert [b["model"] for b in d["balance"]] == ["mixtral_tiny", "deepseek_v3_tiny"]
    for b in d["balance"]:
        assert _times(b["aux_ms"], b["bias_ms"])
        assert b["aux_over_bias"] == pytest.approx(b["aux_ms"] / b["bias_ms"])
        assert sorted(b["losses"]) == ["aux", "bias"] and all(0 < v < 10 for v in b["losses"].values())


def _check_snapshots(d, tmp_path):
    assert (d["world_size"], d["rounds"], d["steps"]) == (2, 1, 4)
    rows = {r["variant"]: r for r in d["rows"]}
    assert list(rows) == ["off", "own", "replica"] and rows["off"]["cost"] == 0
    for r in rows.values():
        assert _times(r["ms"]) and r["cost"] == pytest.approx(r["ms"] / rows["off"]["ms"] - 1)
    own = rows["own"]["held_by_owner"]
    assert [sorted(h) for h in own] == [["0"], ["1"]] and all(h[str(r)] > 0 for r, h in enumerate(own))
    # two nodes of one rank: each holds its own shard and the other's replica, the same bytes as the
    # owner's (within one run: the step's metrics record in rank 0's varies in length between runs)
    replica = rows["replica"]["held_by_owner"]
    assert replica[0] == replica[1] and sorted(replica[0]) == ["0", "1"]
    assert rows["replica"]["held_bytes"] == [sum(replica[0].values())] * 2


def _check_context(d, tmp_path):
    seqs, layers = [64, 128, 256], d["model"]["n_layers"]  # --quick's lengths; cp 1 and the default 2, 4
    routes = {
        1: ["one rank"],
        2: ["alltoall", "ring", "alltoall torch"],
        4: ["alltoall", "ring", "alltoall torch"],
    }
    keys = sorted((cp, r, s) for cp in routes for r in routes[cp] for s in seqs)
    mem = {(m["cp"], m["route"], m["seq_len"]): m for m in d["memory"]}
    ms = {(m["cp"], m["route"], m["seq_len"]): m for m in d["steps_ms"]}
    assert d["seqs"] == seqs and sorted(mem) == keys and sorted(ms) == keys
    for (cp, _, seq), m in mem.items():
        assert m["activation_bytes"] == max(m["activation_bytes_per_rank"]) > 0
        assert len(m["activation_bytes_per_rank"]) == cp and m["mask_buffer_bytes"] == layers * seq * seq
        assert m["loss_rel_vs_cp1"] <= 1e-5, "every route computes the one-rank loss"
        if cp > 1:  # a split sequence keeps less per rank; torch's all-to-all moves the same tensors
            assert m["activation_bytes"] < mem[1, "one rank", seq]["activation_bytes"]
            assert (
                mem[cp, "alltoall torch", seq]["activation_bytes"]
                == mem[cp, "alltoall", seq]["activation_bytes"]
            )
    fits = {(f["cp"], f["route"]): f for f in d["fits"]}
    assert sorted(fits) == sorted((cp, r) for cp in routes for r in routes[cp] if r != "alltoall torch")
    for (cp, route), f in fits.items():
        a, b, c = f["coef"]
        assert f["max_rel_residual"] < 1e-6, "saved tensors are multiples of S and S^2: the fit is exact"
        if route == "ring":
            assert abs(c) < 1e-6 * b, "the ring keeps nothing quadratic in the sequence"
        for key, quad in (("longest_seq", c), ("longest_seq_with_masks", c + layers)):
            s, step = f[key], 2 * cp  # the longest multiple of 2 cp within the budget
            assert s % step == 0 and s > seqs[-1]
            assert a + b * s + quad * s * s <= d["budget_bytes"] < a + b * (s + step) + quad * (s + step) ** 2
    heads = d["model"]["n_heads"]
    assert sorted((k["cp"], k["route"]) for k in d["kv_bytes"]) == [
        (2, "alltoall"),
        (2, "ring"),
        (4, "alltoall"),
        (4, "ring"),
    ]
    for k in d["kv_bytes"]:  # grouped K/V move KV heads (the ring) or lcm(KV, cp) (Ulysses), not all
        kv = k["n_kv_heads"] if k["route"] == "ring" else math.lcm(k["n_kv_heads"], k["cp"])
        share = kv / heads if k["route"] == "ring" else (2 * heads + 2 * kv) / (4 * heads)
        assert k["grouped"] == share * k["repeated"] > 0 and k["ratio"] == share, k
        # latent attention: the ring sends the latent and its rotary key (kv_lora + rope a token, and
        # their gradients) where Llama sends 2 x heads x head_dim; the all-to-all moves q (nope +
        # rope) and the output (v) and gathers the latent, cp x its width against (cp - 1) / cp of
        # Llama's, or, where the latent is the wider (cp 4 here), expands first and moves k and v too
        m, width = d["latent_model"], d["model"]["dim"] // heads
        latent = m["kv_lora_rank"] + 8  # (qk_rope_head_dim's default)
        qk, v = m["qk_nope_head_dim"] + 8, m["v_head_dim"]
        gathers = gathering_sends_less(heads, qk, v, latent, k["cp"])
        assert gathers == (k["cp"] == 2)
        if k["route"] == "ring":
            mla = latent / (2 * heads * width)
        elif gathers:
            mla = (heads * (qk + v) + k["cp"] * latent) / (4 * heads * width)
        else:
            mla = (2 * qk + 2 * v) / (4 * width)
        assert k["latent"] == mla * k["repeated"] and k["latent_ratio"] == mla, k
    for (cp, route, seq), m in ms.items():
        assert _times(m["ms"], m["cpu_ms"]) and m["ms_min"] <= m["ms"] <= m["ms_max"]
        if cp > 1 and route == "ring":
            assert m["ring_speedup"] == pytest.approx(ms[cp, "alltoall", seq]["ms"] / m["ms"])
        if route == "alltoall":
            assert m["ratio_vs_torch_collectives"] == pytest.approx(
                ms[cp, "alltoall torch", seq]["ms"] / m["ms"]
            )
    assert [(r["world"], r["bytes"]) for r in d["all_to_all"]] == [(2, 16 << 10), (4, 16 << 10)]
    for r in d["all_to_all"]:
        assert _times(r["direct_ms"], r["pairwise_ms"], r["torch_ms"])
        assert r["ratio_direct"] == pytest.approx(r["torch_ms"] / r["direct_ms"])
        assert r["ratio_pairwise"] == pytest.approx(r["torch_ms"] / r["pairwise_ms"])


def _check_pipeline(d, tmp_path):
    P, m, v = 2, d["m"], 2  # --quick: pp 2, the default 8 micro-batches; interleaved: 2 chunks a rank
    assert m == 8 and [(r["pp"], r["schedule"], r["v"]) for r in d["runs"]] == [
        (P, "gpipe", 1),
        (P, "1f1b", 1),
        (P, "interleaved", v),
    ]
    in_flight = {  # docs/parallelism.md's table (interleaved: its bound, reached once m v > the warm-up)
        "gpipe": [m] * P,
        "1f1b": [min(P - r, m) for r in range(P)],
        "interleaved": [2 * (P - r - 1) + (v - 1) * P + 1 for r in range(P)],
    }
    for r in d["runs"]:
        assert r["theory"] == pytest.approx((P - 1) / (r["v"] * m + P - 1))
        assert 0 <= r["bubble"] < 1 and _times(r["ours_ms"], r["torch_ms"])
        assert r["ratio"] == pytest.approx(r["ours_ms"] / r["torch_ms"])
        assert r["peak_in_flight"] == in_flight[r["schedule"]]
        assert r["grad_rel_vs_torch"] < 1e-6, "ours and torch's schedule, same chunks: the same gradients"


def _check_gpu_throughput(d, tmp_path):
    assert d["model"]["family"] == "gpt2"  # the preset it was given, not its default MiniGPT
    tokens, params = 2 * d["model"]["seq_len"], _params(d["model"])
    assert d["tokens_per_step"] == tokens and _times(d["bf16_peak_flops"])
    rows = {(r["variant"], r["dtype"]): r for r in d["rows"]}
    assert sorted(rows) == sorted(
        (v, t) for v in ("ours ZeRO-1", "torch DDP + AdamW(fused)") for t in ("fp32", "bf16")
    )
    for (_, dtype), r in rows.items():
        torch_row = rows["torch DDP + AdamW(fused)", dtype]
        assert r["params"] == params and _times(r["step_s"])
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s"])
        assert r["mfu"] == pytest.approx(6 * params * tokens / r["step_s"] / d["bf16_peak_flops"])
        assert r["vs_torch"] == pytest.approx(r["tokens_per_s"] / torch_row["tokens_per_s"])
    fp32 = [rows[v, "fp32"]["last_loss"] for v in ("ours ZeRO-1", "torch DDP + AdamW(fused)")]
    assert fp32[0] == pytest.approx(fp32[1], rel=LOSS_RTOL), "same model, batches and AdamW"


def _check_token_cache(d, tmp_path):
    """Every variant encoded the same number of tokens (each document's ids and its end-of-text);
    the caches of both world sizes are the same bytes."""
    rows = d["rows"]
    assert d["mb"] == 1 and set(rows) == {"ours 1", "ours 2", "tokenizers"} and d["same_bytes"]
    assert len({r["tokens"] for r in rows.values()}) == 1 and rows["tokenizers"]["tokens"] > 0
    assert _times(*(r["seconds"] for r in rows.values()))
    assert len(rows["ours 2"]["rss_mb"]) == 2 and (tmp_path / "corpus1mb.jsonl").stat().st_size >= 1 << 20


def _check_step(d, tmp_path):
    ours = [f"ours stage {s}{o}" for s in (1, 3) for o in ("", " overlap")]
    on_torch = [f"{v} (torch coll)" for v in ours]  # the same on torch's own collectives
    variants = ours + ["torch DDP"]
    rows = {r["variant"]: r for r in d["results"]}
    assert sorted(rows) == sorted(variants + on_torch + [f"{v} (no comm)" for v in variants])  # twins
    params = sum(p.numel() for p in families.build(ModelConfig(), 0).parameters())  # tiny: the capstone's
    ddp = rows["torch DDP"]
    for name, r in rows.items():
        assert (r["model"], r["world"], r["params"], len(r["losses"])) == ("tiny", 2, params, 1 + 2)
        assert _times(r["ms"]) and r["ms_min"] <= r["ms"] <= r["ms_max"]
        assert r["ratio_vs_ddp"] == pytest.approx(ddp["ms"] / r["ms"])
        if name in ours + on_torch:  # ZeRO-1 and -3: 12P/N optimizer bytes per rank
            assert r["optimizer_bytes"] == [12 * params // 2] * 2
    for name in ours:
        assert rows[name]["ratio_vs_torch_collectives"] == pytest.approx(
            rows[f"{name} (torch coll)"]["ms"] / rows[name]["ms"]
        )
        assert (rows[name]["collectives"], rows[f"{name} (torch coll)"]["collectives"]) == ("ours", "torch")
    for name in ours + on_torch:  # the no-comm twins skip communication: their ranks' losses drift apart
        assert rows[name]["losses"] == pytest.approx(ddp["losses"], rel=LOSS_RTOL), name


def _check_ring_documents(d, tmp_path):
    """--quick's rows; a rank never attends more than causal attention's 2 cp + 1 blocks, one text
    attends exactly those everywhere, documents fewer; the ratios are the counts'; the zig-zag's
    pairs of the same chunks attend as many blocks in all, their busiest rank no fewer."""
    rows = d["rows"]
    assert (d["seq"], d["trials"]) == (512, 2)
    assert sorted((r["cp"], r["mean_document"] or 0, r["batch"]) for r in rows) == sorted(
        (cp, mean, batch) for cp in (2, 4) for mean in (64, 0) for batch in (1, 8)
    )
    for r in rows:
        cp, causal = r["cp"], 2 * r["cp"] + 1
        assert r["causal_blocks"] == causal and len(r["blocks"]) == 2
        assert all(len(b) == cp and 0 < min(b) and max(b) <= causal for b in r["blocks"])
        ratios = [max(b) * cp / sum(b) for b in r["blocks"]]
        assert r["max_over_mean"] == pytest.approx(sum(ratios) / 2) and r["worst_max_over_mean"] == max(
            ratios
        )
        for balanced, zigzag in zip(r["blocks"], r["zigzag_blocks"], strict=True):
            assert sum(balanced) == sum(zigzag) and max(balanced) <= max(zigzag)
        if r["mean_document"] is None:
            assert r["blocks"] == r["zigzag_blocks"] == [[causal] * cp] * 2
        else:
            assert r["mean_blocks"] < causal


def _check_plan(d, tmp_path):
    """Three layouts trained: no byte of any category off (activations and the step peak: to the
    byte for the dense two, estimates for the experts' over four expert-parallel ranks, whose errors
    are reported, not judged), and a search that planned layouts in positive times."""
    rows = d["rows"]
    assert len(rows) == 3 and all(r["misses"] == [] for r in rows)
    for r in rows:
        assert (r["params"], r["grads"], r["optimizer"]) == (0, 0, 0), r
        if "mixtral" in r["layout"]:
            assert r["activations"] >= 0 and 0 <= r["step_peak_pct"] < 100, r
        else:
            assert r["activations"] == r["step_peak"] == r["step_peak_pct"] == 0, r
    (fast,) = d["speed"]
    assert (
        fast["search"] == "model=llama dist.world_size=2" and fast["layouts"] > 0 and _times(fast["seconds"])
    )


def _check_plan_time(d, tmp_path):
    """The predicted fastest and three others trained: each measured and predicted, the fastest
    predicted first, and the summary figures computed from the rows."""
    (model,) = d["models"]
    rows = model["rows"]
    assert (model["model"], model["world"], len(rows)) == ("model=llama", 2, 4)
    assert all(r["misses"] == [] and r["measured_ms"] > 0 for r in rows)
    for r in rows:
        assert (
            r["step_ms"] == pytest.approx(r["compute_ms"] + r["comm_ms"] + r["bubble_ms"])
            and r["step_ms"] > 0
        )
    predicted = [r["step_ms"] for r in rows]
    assert predicted[0] == min(predicted) and model["predicted_fastest"] == rows[0]["layout"]
    fastest = min(r["measured_ms"] for r in rows)
    assert model["predicted_fastest_over_measured_fastest"] == pytest.approx(rows[0]["measured_ms"] / fastest)
    from distlib.launch.plan_verify import spearman

    measured = [r["measured_ms"] for r in rows]
    assert model["rank_correlation"] == pytest.approx(spearman(predicted, measured))
    assert d["machine"]["cores"] >= 1 and d["machine"]["flops"] > 0


CHECKS = {
    "plan": _check_plan,
    "plan_time": _check_plan_time,
    "ring_documents": _check_ring_documents,
    "checkpoint": _check_checkpoint,
    "collectives": _check_collectives,
    "context": _check_context,
    "experts": _check_experts,
    "pipeline": _check_pipeline,
    "gpu_throughput": _check_gpu_throughput,
    "snapshots": _check_snapshots,
    "step": _check_step,
    "token_cache": _check_token_cache,
}


def _files(folder) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``: (size, mtime) by path."""
    return {
        os.path.join(d, f): (os.stat(os.path.join(d, f)).st_size, os.stat(os.path.join(d, f)).st_mtime_ns)
        for d, _, files in os.walk(folder)
        for f in files
    }


@pytest.mark.parametrize("name", sorted(RUNS))
def test_benchmark_runs_and_writes_the_documented_json_outside_the_repository(name, tmp_path):
    out = tmp_path / f"{name}.json"
    args = RUNS[name] + ["--json" if name == "gpu_throughput" else "--out", str(out)]
    args += ["--dir", str(tmp_path)] if name in ("checkpoint", "token_cache") else []  # its own files
    before = _files(ROOT / "benchmarks")
    # in a fork of this process, which has imported torch (tests/forkrun.py): the script as a fresh
    # interpreter runs it, without that start (2.5 CPU-s each here)
    proc = run_script(
        args[0],
        *args[1:],
        timeout=300,
        env={"PYTHONDONTWRITEBYTECODE": "1"},  # no __pycache__ beside the scripts either
    )
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-2500:]
    assert _files(ROOT / "benchmarks") == before, "the benchmark wrote into the repository"
    CHECKS[name](json.loads(out.read_text()), tmp_path)


def test_committed_cost_model_is_the_best_fit_to_the_committed_tables():
    """distlib/comm/cost_model.py's constants are what fit_cost_model.py finds on the committed
    --algos tables, and the docstring's "8% longer than the fastest" is its score."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/fit_cost_model.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2500:]
    best, committed = (
        line.split(" over the fastest")[0].split()[-1] for line in proc.stdout.splitlines()[:2]
    )
    assert best == committed == "0.082", proc.stdout
