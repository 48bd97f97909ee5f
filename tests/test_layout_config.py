"""Parallel layouts that cannot work are refused with the key that is wrong, before any worker."""

from pathlib import Path

import pytest
from forkrun import run_script

from distlib.app.config.run import ConfigError, RunConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"dist": {"world_size": 4, "tp": 3}}, "dist.tp=3 must be >= 1 and divide dist.world_size=4"),
        (
            {"dist": {"world_size": 4, "tp": 4}, "model": {"n_heads": 2, "dim": 32}},
            "dist.tp=4 must divide model.n_heads=2",
        ),
        ({"dist": {"world_size": 4, "tp": 0}}, "dist.tp must be an integer >= 1"),
        (
            {"train": {"global_batch": 10}},
            "train.global_batch=10 does not divide into dist.world_size=4 rank(s)",
        ),
        (
            {"dist": {"world_size": 4, "tp": 2}, "train": {"global_batch": 16, "grad_accum": 3}},
            "train.global_batch=16 does not divide into dist.world_size/dist.tp=4/2=2 data-parallel "
            "rank(s) x train.grad_accum=3 micro-batch(es)",
        ),
        (
            {"dist": {"world_size": 4, "cp": 2}, "train": {"global_batch": 3}},
            "train.global_batch=3 does not divide into dist.world_size/dist.cp=4/2=2 data-parallel rank(s)",
        ),
        (
            {"dist": {"world_size": 8, "cp": 2, "pp": 2}, "train": {"global_batch": 3}},
            "train.global_batch=3 does not divide into dist.world_size/(dist.pp x dist.cp)=8/(2 x 2)=2 "
            "data-parallel rank(s)",
        ),
        (
            {"dist": {"world_size": 4, "ep": 3}, "model": {"family": "mixtral"}},
            "dist.ep=3 must divide the batch ranks dp x cp = 4",
        ),
        ({"zero": {"stage": 4}}, "zero.stage must be one of [0, 1, 2, 3], got 4"),
        ({"zero": {"stage": 2, "bucket_numel": 0}}, "zero.bucket_numel must be an integer >= 1"),
        ({"train": {"dtype": "fp16"}}, "train.dtype must be one of"),
    ],
)
def test_bad_layouts_are_config_errors(tree, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(tree)
    assert message in str(err.value)


def test_data_parallel_size_and_global_batch_follow_the_mesh():
    cfg = RunConfig.from_dict(
        {"dist": {"world_size": 4, "tp": 2}, "train": {"global_batch": None, "batch_size": 4}}
    )
    assert (cfg.dp_size, cfg.global_batch) == (2, 8)  # batch_size 4 per data-parallel rank
    cfg = RunConfig.from_dict(
        {"dist": {"world_size": 4, "tp": 2}, "train": {"global_batch": 16, "grad_accum": 2}}
    )
    assert (cfg.dp_size, cfg.global_batch) == (2, 16)


@pytest.mark.slow
def test_cli_refuses_a_bad_layout_before_starting_workers(tmp_path):
    proc = run_script("train.py", "dist.world_size=4", "dist.tp=3", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    assert (
        "config error: invalid parallel layout: dist.tp=3 must be >= 1 and divide dist.world_size=4"
        in proc.stderr
    )
    assert not (tmp_path / "metrics.jsonl").exists()
