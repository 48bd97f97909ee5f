"""optimizer.schedule: warmup, cosine and WSD as a function of the step; every step's rate logged;
a resume inside warmup and inside the decay continues the schedule bit for bit."""

import json
import math

import pytest
from multiproc import run_ranks
from trainrun import compose_tree, train

from distlib.app.config.groups import OptimizerConfig
from distlib.app.config.lr_schedule import lr_at
from distlib.app.config.run import ConfigError, RunConfig


def test_the_default_is_the_configured_float_itself():
    for step in (1, 7, 20):
        assert lr_at(step, OptimizerConfig(lr=0.01), 20).hex() == (0.01).hex()


def test_warmup_then_cosine_to_the_floor():
    cfg = OptimizerConfig(lr=1.0, schedule="cosine", warmup_steps=4, min_lr_ratio=0.1)
    lrs = [lr_at(t, cfg, 20) for t in range(1, 21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 16)))
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:]))  # decays every step after warmup
    assert lrs[-1] == pytest.approx(0.1)


def test_wsd_is_stable_until_its_decay_phase():
    cfg = OptimizerConfig(lr=2.0, schedule="wsd", warmup_steps=2, decay_steps=4, min_lr_ratio=0.0)
    lrs = [lr_at(t, cfg, 10) for t in range(1, 11)]
    assert lrs == [1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 1.5, 1.0, 0.5, 0.0]


@pytest.mark.parametrize(
    "optimizer, message",
    [
        ({"schedule": "linear"}, "optimizer.schedule must be one of"),
        ({"schedule": "wsd"}, "needs optimizer.decay_steps"),
        ({"schedule": "cosine", "decay_steps": 3}, "used by schedule=wsd only"),
        ({"warmup_steps": -1}, "optimizer.warmup_steps must be an integer >= 0, got -1"),
        (
            {"schedule": "wsd", "warmup_steps": 15, "decay_steps": 6},
            "optimizer.warmup_steps=15 \\+ optimizer.decay_steps=6 exceed train.steps=20: "
            "pass train.steps >= 21 ",
        ),
        ({"warmup_steps": 25}, "optimizer.warmup_steps=25 exceeds train.steps=20: pass train.steps >= 25 "),
        ({"min_lr_ratio": 2.0}, "optimizer.min_lr_ratio must be a number >= 0 and <= 1"),
    ],
)
def test_bad_schedules_name_the_key(optimizer, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RunConfig.from_dict({"optimizer": optimizer})


SCHEDULE = [
    "optimizer.schedule=wsd",
    "optimizer.warmup_steps=3",
    "optimizer.decay_steps=3",
    "optimizer.min_lr_ratio=0.1",
    "optimizer.lr=0.02",
    "model.dropout=0.1",
]
BASE = [
    "dist.world_size=2",
    "train.steps=8",
    "checkpoint.every_steps=2",
    "checkpoint.verify_resume=false",
    "metrics.progress_every=0",
]


def _steps(run_dir):
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["type"] == "step"]


def test_every_steps_rate_is_logged_and_a_resume_inside_warmup_or_decay_is_bitwise(tmp_path):
    full = run_ranks(train, 2, compose_tree(BASE + SCHEDULE), str(tmp_path / "full"))[0]
    cfg = OptimizerConfig(lr=0.02, schedule="wsd", warmup_steps=3, decay_steps=3, min_lr_ratio=0.1)
    logged = [r["lr"] for r in _steps(tmp_path / "full")]
    assert logged == [lr_at(t, cfg, 8) for t in range(1, 9)]
    assert logged[0] < logged[3] == 0.02 > logged[-1]  # warmup, stable, decay all happened
    constant = run_ranks(train, 2, compose_tree(BASE + SCHEDULE[-2:]), str(tmp_path / "constant"))[0]
    assert constant["losses"][2] != full["losses"][2]  # the schedule changes the updates
    for at in (2, 6):  # inside warmup (1-3), inside decay (6-8)
        checkpoint = tmp_path / "full" / "checkpoints" / f"step_{at:08d}"
        resumed = run_ranks(
            train,
            2,
            compose_tree(BASE + SCHEDULE + [f"checkpoint.resume={checkpoint}"]),
            str(tmp_path / f"resumed{at}"),
        )[0]
        assert resumed["losses"] == {s: h for s, h in full["losses"].items() if s > at}
        assert (resumed["params"] == full["params"]).all()
        assert [r["lr"] for r in _steps(tmp_path / f"resumed{at}")] == logged[at:]
