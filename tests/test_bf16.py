"""bf16 mixed precision on the capstone: bf16 parameters and activations for compute, fp32
master weights, gradients and Adam state; the loss still falls and 12P/N still holds."""

from __future__ import annotations

from pathlib import Path

from multiproc import run_ranks

from distlib.app.config.run import RunConfig
from distlib.app.observe import summary
from distlib.app.trainer import Trainer
from distlib.comm import agree
from distlib.launch.torchrun import use_deterministic_kernels


def _capstone_bf16(comm, run_dir: str, stage: int):
    use_deterministic_kernels()  # the product's switch: the same ATen flag, without torch._inductor
    run_dir = Path(run_dir) / f"stage{stage}"
    if comm.rank == 0:
        run_dir.mkdir()
    agree.all_true(True, comm)
    cfg = RunConfig.from_dict({"train": {"dtype": "bf16"}, "zero": {"stage": stage}})  # capstone otherwise
    trainer = Trainer(cfg, comm, run_dir)
    dtypes = {
        "params": {str(p.dtype) for p in trainer.model.parameters()},
        "state": {k: str(v.dtype) for k, v in trainer.optimizer.state_shard().items()},
    }
    result = trainer.run()
    return {
        "losses": [s.loss for s in result.steps],
        "failures": summary.check_invariants(result, cfg.train.loss_tolerance, cfg.train.monotone_until_step),
        "memory": result.memory,
        "numel": result.numel,
        "dtypes": dtypes,
    }


def test_bf16_capstone_trains_with_fp32_optimizer_state(tmp_path):
    r = run_ranks(_capstone_bf16, 4, str(tmp_path), 1)[0]  # ZeRO-1, the capstone's stage
    assert r["dtypes"]["params"] == {"torch.bfloat16"}
    assert set(r["dtypes"]["state"].values()) == {"torch.float32"}
    assert r["losses"][-1] < 0.5 * r["losses"][0], r["losses"]
    # invariants: monotone loss, equal parameter norms, memory formula, byte-identical resume
    assert r["failures"] == [], r["failures"]
    p = r["numel"]
    for row in r["memory"]:
        assert row["measured"]["optimizer"] == 12 * p // 4  # 12P/N, P divisible by 4 here
        assert 2 * p <= row["measured"]["params"] <= 2 * p + row["allowance"]["params"]  # bf16: 2 bytes each
