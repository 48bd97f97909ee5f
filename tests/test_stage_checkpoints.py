"""Checkpoints do not depend on the ZeRO stage, and tensor-parallel checkpoints say how to
reassemble themselves.

Every stage saves partition r of the fp32 (master, exp_avg, exp_avg_sq) in FlatLayout order,
so a checkpoint written at stage s resumes at stage s' (same world size) and continues exactly
like the uninterrupted run. With one micro-batch every stage reduces the same numbers in the
same rank order, so "exactly" is bitwise here.
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch
from multiproc import run_ranks

from distlib.app.config.run import RunConfig
from distlib.app.trainer import Trainer
from distlib.launch.torchrun import use_deterministic_kernels
from distlib.parallel.tensor_parallel import Split

MODEL = {"vocab_size": 30, "seq_len": 8, "dim": 16, "n_heads": 4, "n_layers": 2, "mlp_ratio": 2}
PAIRS = [(0, 3), (3, 1), (1, 2), (2, 0)]  # every stage saves once and loads once


def _cfg(
    stage: int, tp: int = 1, resume: str | None = None, every: int = 2, world_size: int = 2
) -> RunConfig:
    # Held-out evaluation every 2 steps, over 9 windows: the data-parallel ranks score 4 and 5, so
    # they have 1 and 2 batches, which a ZeRO-3 or tensor-parallel (collective) forward must survive.
    return RunConfig.from_dict(
        {
            "model": MODEL,
            "zero": {"stage": stage, "bucket_numel": 600},
            "data": {"total_tokens": 4096, "val_fraction": 0.1},
            "train": {"steps": 4, "global_batch": 8, "eval_every": 2, "eval_windows": 9},
            "dist": {"world_size": world_size, "tp": tp},
            "checkpoint": {"every_steps": every, "resume": resume, "verify_resume": every > 0},
        }
    )


def _train(comm, cfg: RunConfig, run_dir: Path):
    if comm.rank == 0:
        run_dir.mkdir(parents=True)
    use_deterministic_kernels()  # the product's switch: the same ATen flag, without torch._inductor
    from distlib.comm import agree

    agree.all_true(True, comm)  # the directory exists before anyone opens metrics in it
    return Trainer(cfg, comm, run_dir).run()


def _cross_stage(comm, root: str):
    root, out = Path(root), []
    for save_stage, load_stage in PAIRS:
        first = _train(comm, _cfg(save_stage), root / f"save{save_stage}")
        ckpt = root / f"save{save_stage}" / "checkpoints" / "step_00000002"
        resumed = _train(
            comm, _cfg(load_stage, resume=str(ckpt), every=0), root / f"load{save_stage}{load_stage}"
        )
        out.append(
            {
                "first": [s.loss for s in first.steps],
                "resumed": [s.loss for s in resumed.steps],
                "start": resumed.start_step,
                "restored": first.resume_check.ok,
                "val": [s.val_loss for s in first.steps],
                "val_resumed": [s.val_loss for s in resumed.steps],
            }
        )
    return out


def test_checkpoint_saved_at_any_stage_resumes_at_any_other(tmp_path):
    results = run_ranks(_cross_stage, 2, str(tmp_path))
    for (save_stage, load_stage), r in zip(PAIRS, results[0]):
        assert r["restored"], f"stage {save_stage}: the step-2 checkpoint did not restore byte-identically"
        assert r["start"] == 2
        assert r["resumed"] == r["first"][2:], (
            f"saved at stage {save_stage}, resumed at stage {load_stage}: "
            f"{r['resumed']} vs uninterrupted {r['first'][2:]}"
        )
        assert r["val_resumed"] == r["val"][2:] and r["val"][1] is not None and r["val"][3] is not None
    # the stage-0 and stage-3 runs themselves agree bitwise (one micro-batch), so the check has teeth
    assert results[0][0]["first"] == results[0][1]["first"]
    assert results[0][0]["val"] == results[0][1]["val"]


def _two_d(comm, root: str):
    result = _train(comm, _cfg(3, tp=2, world_size=4), Path(root) / "dp2tp2")
    return [s.loss for s in result.steps], [s.val_loss for s in result.steps]


def _tensor_parallel(comm, root: str):
    root = Path(root)
    from_2d = _train(
        comm,
        _cfg(1, tp=2, resume=str(root / "dp2tp2" / "checkpoints" / "step_00000002"), every=0),
        root / "dp2tp2_to_dp1tp2",
    )
    first = _train(comm, _cfg(3, tp=2), root / "tp2")
    ckpt = root / "tp2" / "checkpoints" / "step_00000004"
    resumed = _train(
        comm,
        _cfg(1, tp=2, resume=str(root / "tp2" / "checkpoints" / "step_00000002"), every=0),
        root / "tp2_resumed",
    )
    single = _train(comm, _cfg(1, tp=1), root / "dp2")
    # another tensor-parallel degree: the pieces are cut again (distlib/checkpoint/relayout.py)
    retp = _train(comm, _cfg(1, tp=1, resume=str(ckpt), every=0), root / "tp2_to_tp1")
    return {
        "first": [s.loss for s in first.steps],
        "resumed": [s.loss for s in resumed.steps],
        "single": [s.loss for s in single.steps],
        "retp": [s.loss for s in retp.steps],
        "restored": first.resume_check.ok,
        "from_2d": [s.loss for s in from_2d.steps],
        "val": [s.val_loss for s in first.steps],
        "single_val": [s.val_loss for s in single.steps],
    }


def _reassemble(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full parameters from a tensor-parallel checkpoint, using nothing but its manifest."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    tp, dp = manifest["tp"], manifest["dp"]
    pieces: dict[str, list] = {}
    for t, layout in enumerate(manifest["tp_layouts"]):
        flat = torch.cat(
            [
                safetensors.torch.load_file(ckpt / f"rank{d * tp + t:05d}.safetensors")["master"]
                for d in range(dp)
            ]
        )
        for p in layout["params"]:
            local = flat[p["offset"] : p["offset"] + p["numel"]].view(p["shape"])
            pieces.setdefault(p["name"], []).append((p["split"], local, p["full_shape"]))
    full = {}
    for name, parts in pieces.items():
        split, _, shape = parts[0]
        if split is None:
            full[name] = parts[0][1]
            continue
        s = Split(**split)
        groups = [[local.chunk(s.groups, dim=s.dim)[g] for _, local, _ in parts] for g in range(s.groups)]
        full[name] = torch.cat([torch.cat(g, dim=s.dim) for g in groups], dim=s.dim)
        assert list(full[name].shape) == shape
    return full


def test_tensor_parallel_checkpoint_resumes_and_records_its_layout(tmp_path):
    two_d_losses, two_d_val = run_ranks(_two_d, 4, str(tmp_path))[0]
    r = run_ranks(_tensor_parallel, 2, str(tmp_path))[0]
    assert r["restored"]
    assert r["resumed"] == r["first"][2:]
    for got, want in zip(r["first"] + r["val"][1::2], r["single"] + r["single_val"][1::2]):
        assert abs(got - want) <= 1e-5 * want  # tp=2 (ZeRO-3) trains and evaluates like tp=1
    # saved by 2 DP x 2 TP, resumed by 1 DP x 2 TP: the data-parallel partitions are resharded
    for got, want in zip(r["from_2d"], two_d_losses[2:]):
        assert abs(got - want) <= 1e-5 * want
    assert two_d_val[1] is not None and abs(two_d_val[1] - r["single_val"][1]) <= 1e-5 * r["single_val"][1]
    # saved at tp=2 (ZeRO-3), resumed at tp=1 (ZeRO-1): continues like the tp=1 run
    assert len(r["retp"]) == len(r["single"]) - 4
    for got, want in zip(r["retp"], r["single"][4:]):
        assert abs(got - want) <= 1e-5 * want

    manifest = json.loads((tmp_path / "tp2/checkpoints/step_00000004/manifest.json").read_text())
    qkv = [
        next(p for p in layout["params"] if p["name"] == "blocks.0.attn.qkv.weight")
        for layout in manifest["tp_layouts"]
    ]
    assert [q["split"] for q in qkv] == [{"dim": 0, "parts": 2, "index": t, "groups": 3} for t in range(2)]
    assert qkv[0]["full_shape"] == [48, 16] and qkv[0]["shape"] == [24, 16]
    tp_full = _reassemble(tmp_path / "tp2/checkpoints/step_00000004")
    single = safetensors.torch.load_file(tmp_path / "dp2/checkpoints/step_00000004/rank00000.safetensors")[
        "master"
    ]
    single_manifest = json.loads((tmp_path / "dp2/checkpoints/step_00000004/manifest.json").read_text())
    half = single_manifest["layout"]["shard_numel"]
    rest = safetensors.torch.load_file(tmp_path / "dp2/checkpoints/step_00000004/rank00001.safetensors")[
        "master"
    ]
    flat = torch.cat([single, rest])
    assert half * 2 == flat.numel()
    # one relative error over the whole model (see test_parallel: the key bias is rounding noise)
    got = torch.cat([tp_full[p["name"]].reshape(-1) for p in single_manifest["layout"]["params"]])
    want = flat[: got.numel()]
    err = float((got - want).norm() / want.norm())
    assert err <= 1e-5, f"weights reassembled from the tensor-parallel checkpoint differ by {err:.2e}"
