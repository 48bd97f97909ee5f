"""metrics.tensorboard=true: rank 0's step records also as TensorBoard event files, read back with
TensorBoard's own reader and equal to the JSONL values; off by default and then nothing imports
tensorboard; without the package the option is one config error line and the rest works."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from multiproc import run_ranks
from trainrun import compose_tree, small_tree, train, tree_with

import train as train_script
from distlib.app.observe.tensorboard import FIELDS

ROOT = Path(__file__).resolve().parent.parent
MEMORY = ("params_bytes", "grads_bytes", "optimizer_bytes", "peak_rss_bytes", "activation_bytes")


def _steps(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["type"] == "step"}


def _field(record: dict, tag: str):
    value = record
    for part in tag.split("/"):
        value = value[part]
    return value


def test_event_files_hold_the_jsonl_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tree = tree_with(
        small_tree(4, 0),
        metrics={"tensorboard": True, "progress_every": 0},
        data={"val_fraction": 0.25},
        train={"eval_every": 2, "eval_windows": 8},
        checkpoint={"verify_resume": False},
    )
    run_ranks(train, 2, tree, str(tmp_path))
    records = _steps(tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    memory = [f"memory/{k}/{stat}" for k in MEMORY for stat in ("max", "mean")]
    assert sorted(tags) == sorted([*FIELDS, *memory])
    for tag in tags:
        logged = {s.step: s for s in events.Scalars(tag)}
        expected = {step: r for step, r in records.items() if r.get(tag.split("/")[0]) is not None}
        assert sorted(logged) == sorted(expected) == ([2, 4] if tag == "val_loss" else [1, 2, 3, 4]), tag
        for step, scalar in logged.items():
            want = np.float32(float(_field(expected[step], tag)))  # TensorBoard keeps a float32
            assert np.float32(scalar.value) == want or (math.isnan(want) and math.isnan(scalar.value)), tag
            assert scalar.wall_time == expected[step]["time"], tag


def _short_run(comm, tree: dict, run_dir: str) -> list[str]:
    for name in ("tensorboard", "torch.utils.tensorboard"):
        assert sys.modules.get(name) is None  # hidden, as if the package were not installed
    train(comm, tree, run_dir)
    return sorted(p.name for p in Path(run_dir).iterdir())


def test_without_tensorboard_the_option_is_one_config_error_line_and_runs_go_on(
    monkeypatch, capsys, tmp_path
):
    for name in ("tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # `import tensorboard` now fails
    with pytest.raises(SystemExit) as exit_:
        train_script.checked_config(compose_tree(["metrics.tensorboard=true"]))  # before any worker starts
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err == (
        "config error: metrics.tensorboard=true needs the optional `tensorboard` extra "
        "(pip install tensorboard==2.21.0), which is not installed\n"
    )
    tree = compose_tree(["train.steps=2", "checkpoint.every_steps=0", "dist.world_size=1"])
    assert train_script.checked_config(tree).metrics.tensorboard is False
    listing = run_ranks(_short_run, 1, tree, str(tmp_path / "run"))[0]  # forked: still hidden there
    assert "metrics.jsonl" in listing and "tensorboard" not in listing


def test_nothing_imports_tensorboard_or_the_compiler_unless_asked(tmp_path):
    code = (
        "import sys, time\n"
        "import train\n"
        "from distlib.app.trainer import Trainer\n"
        "optional = ('tensorboard', 'torch.utils.tensorboard', 'tokenizers', 'transformers')\n"
        "found = [m for m in (*optional, 'torch._dynamo') if m in sys.modules]\n"
        "assert not found, f'imported at start-up: {found}'\n"
        "from distlib.app.observe.tensorboard import TensorBoardLog\n"
        "log = TensorBoardLog(sys.argv[1])\n"
        "log.write({'step': 1, 'time': time.time(), 'loss': 1.0, 'memory': {}})\n"
        "log.close()\n"
        "assert 'torch._dynamo' not in sys.modules, 'the writer imported torch._dynamo'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "tensorboard").iterdir()), "no event file written"
