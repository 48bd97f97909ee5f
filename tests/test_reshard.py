"""A checkpoint saved by N ranks continues on M ranks, at any ZeRO stage, with the saved state loaded
bit for bit; offline (scripts/ckpt.py reshard) and online resharding agree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_util import train, tree
from multiproc import run_ranks

from distlib.app.config.run import RunConfig
from distlib.app.trainer import Trainer
from distlib.checkpoint import offline
from distlib.checkpoint import sharded as checkpoint
from distlib.parallel.adamw import STATE_KEYS


# -- through the trainer ------------------------------------------------------
@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict:
    """An uninterrupted 4-rank ZeRO-1 run: checkpoints at steps 3 and 6, losses of steps 1..8."""
    run = tmp_path_factory.mktemp("four")
    results = train(tree(4, steps=8), run)
    return {"losses": results[0]["losses"], "step6": run / "checkpoints" / "step_00000006"}


def _master(ckpt) -> np.ndarray:
    return offline.full_state(ckpt, checkpoint.verify(ckpt))["master"].numpy()


@pytest.mark.parametrize("world_size, stage", [(2, 1), (2, 0), (1, 1)])
def test_first_step_after_reshard_matches_continuing_at_four(tmp_path, four, world_size, stage, capfd):
    results = train(
        tree(world_size, steps=8, zero={"stage": stage}, checkpoint={"resume": str(four["step6"])}), tmp_path
    )
    out = capfd.readouterr().out
    ours = f"dp {world_size}" if world_size > 1 else "one rank"
    assert (
        f"saved by 4 rank(s) at ZeRO stage 1 (dp 4), loaded into {world_size} at stage {stage} ({ours})"
        in (out)
    )
    first = results[0]
    assert first["start"] == 6
    # Step 7's loss is computed from the restored weights, which are the checkpoint's bytes;
    # it differs from the 4-rank run's only by the order of the reduction over the batch.
    expected, got = four["losses"][7], first["losses"][7]
    assert abs(got - expected) <= 1e-6 * abs(expected), (got, expected)
    assert abs(first["losses"][8] - four["losses"][8]) <= 1e-5 * abs(four["losses"][8])
    for r in results:  # every rank holds the same parameters
        assert np.array_equal(r["params"], results[0]["params"])


def test_a_different_global_batch_is_refused_with_the_fix(tmp_path, four):
    config = tree(3, checkpoint={"resume": str(four["step6"])})
    config["train"]["global_batch"] = 12  # 16 does not divide over 3 ranks
    results = train(config, tmp_path)
    for r in results:
        assert "global batch: checkpoint 16 sequences per step, this run 12" in r["error"]
        assert "Set train.global_batch=16" in r["error"]


def _load_params(comm, config: dict, run_dir: str) -> dict:
    trainer = Trainer(RunConfig.from_dict(config), comm, Path(run_dir))
    trainer.checkpointer.loader.load(Path(config["checkpoint"]["resume"]), trainer.model, trainer.optimizer)
    return {
        "params": trainer.optimizer.full_params().numpy().copy(),
        "state": {k: v.numpy().copy() for k, v in trainer.optimizer.state_shard().items()},
        "rng": torch.get_rng_state().numpy().copy(),
    }


def test_loaded_state_is_the_checkpoint_bit_for_bit(tmp_path, four):
    ckpt = four["step6"]
    manifest = checkpoint.verify(ckpt)
    full = offline.full_state(ckpt, manifest)
    loaded = run_ranks(_load_params, 2, tree(2, checkpoint={"resume": str(ckpt)}), str(tmp_path))
    numel = int(manifest["layout"]["numel"])
    for key in STATE_KEYS:
        assert np.array_equal(np.concatenate([x["state"][key] for x in loaded])[:numel], full[key].numpy())
    for rank, r in enumerate(loaded):
        assert np.array_equal(r["params"], full["master"].numpy())
        saved_rng = checkpoint.load_shard(ckpt, rank)[0]["rng.torch"].numpy()
        assert np.array_equal(r["rng"], saved_rng), f"rank {rank} must take saved rank {rank}'s RNG"


def test_growing_the_world_reseeds_new_ranks_and_says_so(tmp_path, four, capfd):
    two = tmp_path / "two"
    train(tree(2, steps=6), two)
    loaded = run_ranks(
        _load_params,
        4,
        tree(4, checkpoint={"resume": str(two / "checkpoints" / "step_00000006")}),
        str(tmp_path),
    )
    assert "rank(s) [2, 3] have no saved RNG state" in capfd.readouterr().out
    for rank in (0, 1):
        saved = checkpoint.load_shard(two / "checkpoints" / "step_00000006", rank)[0]["rng.torch"].numpy()
        assert np.array_equal(loaded[rank]["rng"], saved)
    fresh = [torch.manual_seed(1234 + r).get_state().numpy() for r in (2, 3)]
    assert np.array_equal(loaded[2]["rng"], fresh[0]) and np.array_equal(loaded[3]["rng"], fresh[1])


def test_offline_reshard_matches_online_reshard(tmp_path, four):
    out = offline.reshard_checkpoint(four["step6"], tmp_path / "step_00000006", 2)
    manifest = checkpoint.verify(out)
    assert manifest["world_size"] == 2 and manifest["layout"]["world_size"] == 2
    assert manifest["resharded_from"]["world_size"] == 4
    assert np.array_equal(_master(out), _master(four["step6"]))
    from_tool = train(tree(2, steps=8, checkpoint={"resume": str(out)}), tmp_path / "a")
    online = train(tree(2, steps=8, checkpoint={"resume": str(four["step6"])}), tmp_path / "b")
    assert from_tool[0]["losses"] == online[0]["losses"]  # same bytes in, same world: bitwise equal
