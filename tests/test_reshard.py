"""A checkpoint saved by N ranks continues on M ranks, at any ZeRO stage, with the saved state loaded
bit for bit; offline (scripts/ckpt.py reshard) and online resharding agree."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_util import train, tree
from multiproc import run_ranks

from distlib.app.config.run import RunConfig
from distlib.app.trainer import Trainer
from distlib.checkpoint import reshard
from distlib.checkpoint import sharded as checkpoint
from distlib.parallel.adamw import STATE_KEYS


# -- the rule -----------------------------------------------------------------
def _partitions(full: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    size = -(-full.numel() // world_size)
    padded = torch.cat([full, torch.zeros(size * world_size - full.numel())])
    return list(padded.split(size))


def test_repartition_and_partition_sources_agree_for_many_shapes():
    rng = random.Random(0)
    for _ in range(200):
        numel, old, new = rng.randint(1, 97), rng.randint(1, 9), rng.randint(1, 9)
        full = torch.arange(1, numel + 1, dtype=torch.float32)
        parts = reshard.repartition(_partitions(full, old), numel, new)
        assert [p.numel() for p in parts] == [-(-numel // new)] * new
        assert torch.equal(torch.cat(parts)[:numel], full)
        assert not torch.cat(parts)[numel:].any(), "padding must be zeros"
        old_parts = _partitions(full, old)
        for rank in range(new):
            pieces = [old_parts[r][a:b] for r, a, b in reshard.partition_sources(numel, old, new, rank)]
            real = torch.cat(pieces) if pieces else torch.zeros(0)
            assert torch.equal(real, parts[rank][: real.numel()]) and not parts[rank][real.numel() :].any()


def test_repartition_refuses_too_few_elements():
    with pytest.raises(checkpoint.CheckpointError, match="fewer than"):
        reshard.repartition([torch.zeros(3)], 5, 2)


# -- through the trainer ------------------------------------------------------
@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict:
    """An uninterrupted 4-rank ZeRO-1 run: checkpoints at steps 3 and 6, losses of steps 1..8."""
    run = tmp_path_factory.mktemp("four")
    results = train(tree(4, steps=8), run)
    return {"losses": results[0]["losses"], "step6": run / "checkpoints" / "step_00000006"}


def _master(ckpt) -> np.ndarray:
    return reshard.full_state(ckpt, checkpoint.verify(ckpt))["master"].numpy()


@pytest.mark.parametrize("world_size, stage", [(2, 1), (2, 0), (1, 1)])
def test_first_step_after_reshard_matches_continuing_at_four(tmp_path, four, world_size, stage, capfd):
    results = train(
        tree(world_size, steps=8, zero={"stage": stage}, checkpoint={"resume": str(four["step6"])}), tmp_path
    )
    out = capfd.readouterr().out
    assert f"saved by 4 rank(s) at ZeRO stage 1, loaded into {world_size} at stage {stage}" in out
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
    numel = trainer.optimizer.layout.numel
    return {
        "params": trainer.optimizer.flat_params[:numel].numpy().copy(),
        "state": {k: v.numpy().copy() for k, v in trainer.optimizer.state_shard().items()},
        "rng": torch.get_rng_state().numpy().copy(),
    }


def test_loaded_state_is_the_checkpoint_bit_for_bit(tmp_path, four):
    ckpt = four["step6"]
    manifest = checkpoint.verify(ckpt)
    full = reshard.full_state(ckpt, manifest)
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
    out = reshard.reshard_checkpoint(four["step6"], tmp_path / "step_00000006", 2)
    manifest = checkpoint.verify(out)
    assert manifest["world_size"] == 2 and manifest["layout"]["world_size"] == 2
    assert manifest["resharded_from"]["world_size"] == 4
    assert np.array_equal(_master(out), _master(four["step6"]))
    offline = train(tree(2, steps=8, checkpoint={"resume": str(out)}), tmp_path / "a")
    online = train(tree(2, steps=8, checkpoint={"resume": str(four["step6"])}), tmp_path / "b")
    assert offline[0]["losses"] == online[0]["losses"]  # same bytes in, same world: bitwise equal
