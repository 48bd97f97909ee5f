"""A save commits atomically: a crash or a full disk during it leaves the previous checkpoint loadable,
keep_last prunes only after a newer one commits, and resume=latest picks the newest that verifies."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ckpt_util import train, tree

from distlib.app.checkpointing.retention import remove_unfinished
from distlib.app.runtime.faults import SAVE_CRASH_POINTS
from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.sharded import CheckpointError


def _committed(run: Path) -> list[str]:
    return [p.name for p in checkpoint.list_committed(run / "checkpoints")]


def _partials(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.endswith(".partial"))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    """An uninterrupted 8-step 2-rank run (checkpoints at 3 and 6): the losses to reproduce."""
    run = tmp_path_factory.mktemp("clean")
    results = train(tree(2, steps=8), run)
    return {"losses": results[0]["losses"], "run": run}


@pytest.mark.parametrize("point", SAVE_CRASH_POINTS)
def test_crash_during_save_leaves_previous_checkpoint_loadable(tmp_path, clean, point):
    run = tmp_path / "run"
    with pytest.raises(AssertionError, match="rank 0 exited with code -9"):
        train(tree(2, steps=8, fault={"crash_in_save": point, "save_fault_step": 6}), run)
    committed = point == "after_commit"
    assert _committed(run) == ["step_00000003"] + (["step_00000006"] if committed else [])
    assert _partials(run) == ([] if committed else [".step_00000006.partial"])
    for path in checkpoint.list_committed(run / "checkpoints"):  # whatever is committed verifies
        checkpoint.verify(path)

    resumed = train(tree(2, steps=8, checkpoint={"resume": "latest"}), run)
    assert resumed[0]["error"] is None
    assert resumed[0]["start"] == (6 if committed else 3)
    # Exact resume: the steps after the crash reproduce the uninterrupted run bit for bit.
    assert resumed[0]["losses"] == {s: v for s, v in clean["losses"].items() if s > resumed[0]["start"]}
    assert _partials(run) == []  # the stale partial was removed by the next save of step 6
    assert _committed(run) == ["step_00000003", "step_00000006"]
    checkpoint.verify(run / "checkpoints" / "step_00000006")


def test_full_disk_fails_every_rank_loudly_and_keeps_previous(tmp_path):
    run = tmp_path / "run"
    results = train(tree(2, fault={"disk_full_rank": 1, "save_fault_step": 6}), run)
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and None not in errors, "every rank must fail with the same error"
    error = errors.pop()
    assert "checkpoint save of step 6 failed, nothing committed: rank 1 writing" in error
    assert "No space left on device" in error and "rank 0" not in error
    assert _committed(run) == ["step_00000003"]
    assert _partials(run) == []  # the half-written shards are gone, so the space is free again
    checkpoint.verify(run / "checkpoints" / "step_00000003")


def test_keep_last_prunes_only_after_a_newer_checkpoint_commits(tmp_path):
    run = tmp_path / "run"
    first = train(tree(2, steps=8, every=2, checkpoint={"keep_last": 2, "verify_resume": True}), run)
    assert _committed(run) == ["step_00000006", "step_00000008"]
    assert all(r["resume_ok"] for r in first)  # the byte-identical reload used a checkpoint that still exists

    # The save of step 10 dies before its commit: keep_last=1 must not have removed anything yet.
    with pytest.raises(AssertionError, match="exited with code -9"):
        train(
            tree(
                2,
                steps=12,
                every=2,
                checkpoint={"keep_last": 1, "resume": "latest"},
                fault={"crash_in_save": "before_commit", "save_fault_step": 10},
            ),
            run,
        )
    assert _committed(run) == ["step_00000006", "step_00000008"]

    train(tree(2, steps=12, every=2, checkpoint={"keep_last": 1, "resume": "latest"}), run)
    assert _committed(run) == ["step_00000012"] and _partials(run) == []


def test_keep_last_zero_keeps_every_checkpoint(tmp_path):
    train(tree(1, steps=6, every=2, checkpoint={"keep_last": 0}), tmp_path)
    assert _committed(tmp_path) == ["step_00000002", "step_00000004", "step_00000006"]


def test_resume_latest_with_no_checkpoint_starts_fresh_and_says_so(tmp_path, capsys):
    result = train(tree(1, steps=2, checkpoint={"resume": "latest"}), tmp_path)[0]
    assert result["start"] == 0 and sorted(result["losses"]) == [1, 2]
    assert f"resume: no checkpoint in {tmp_path / 'checkpoints'}; starting fresh" in capsys.readouterr().out


def test_resume_latest_skips_damaged_and_uncommitted(tmp_path, clean, capfd):
    run = tmp_path / "run"
    shutil.copytree(clean["run"] / "checkpoints", run / "checkpoints")
    root = run / "checkpoints"
    shard = root / "step_00000006" / "rank00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    (root / "step_00000007").mkdir()  # never committed: no manifest
    shutil.copytree(root / "step_00000003", root / ".step_00000008.partial")
    capfd.readouterr()

    result = train(tree(2, steps=8, checkpoint={"resume": "latest"}), run)[0]
    assert result["error"] is None and result["start"] == 3
    assert result["losses"] == {s: v for s, v in clean["losses"].items() if s > 3}
    err = capfd.readouterr().err
    assert "skipping a damaged checkpoint" in err and "step_00000006.damaged" in err
    assert f"checkpoint {root / 'step_00000006'}: file rank00001.safetensors has" in err
    assert (root / "step_00000006.damaged" / "rank00001.safetensors").exists()  # kept for inspection
    checkpoint.verify(root / "step_00000006")  # and step 6 was saved again, intact


def test_resume_latest_refuses_when_every_checkpoint_is_damaged(tmp_path, clean):
    shutil.copytree(clean["run"] / "checkpoints", tmp_path / "checkpoints")
    for step in ("step_00000003", "step_00000006"):
        (tmp_path / "checkpoints" / step / "rank00000.safetensors").unlink()
    result = train(tree(1, checkpoint={"resume": "latest"}), tmp_path)[0]
    assert (
        "none of the 2 checkpoint(s)" in result["error"]
        and "rank00000.safetensors is missing" in result["error"]
    )


def test_resume_path_loads_exactly_that_or_fails(tmp_path, clean):
    root = clean["run"] / "checkpoints"
    result = train(tree(2, steps=8, checkpoint={"resume": str(root / "step_00000003")}), tmp_path / "a")[0]
    assert result["start"] == 3
    missing = train(tree(2, checkpoint={"resume": str(root / "step_00000004")}), tmp_path / "b")
    assert all(f"checkpoint {root / 'step_00000004'} does not exist" == r["error"] for r in missing)


def test_existing_checkpoint_is_never_overwritten(tmp_path):
    train(tree(1, steps=6, every=3), tmp_path)
    before = (tmp_path / "checkpoints" / "step_00000006" / "manifest.json").read_bytes()
    # a fresh run into the same directory is refused before it trains
    fresh = train(tree(1, steps=6, every=3, seed=7), tmp_path)[0]
    assert "already holds checkpoint(s) up to step_00000006" in fresh["error"]
    # resuming an older checkpoint there would re-save step 6: the save refuses
    older = str(tmp_path / "checkpoints" / "step_00000003")
    result = train(tree(1, steps=6, every=3, checkpoint={"resume": older}), tmp_path)[0]
    assert "refusing to overwrite existing checkpoint" in result["error"]
    assert (tmp_path / "checkpoints" / "step_00000006" / "manifest.json").read_bytes() == before
    with pytest.raises(CheckpointError):
        checkpoint.begin(tmp_path / "checkpoints" / "step_00000006")


def test_the_runs_end_removes_unfinished_saves_and_nothing_else(tmp_path):
    # a crash inside step 10's save that a resume from step 10's memory snapshot then went past:
    # no save of step 10 comes again to remove its partial directory
    root = tmp_path / "checkpoints"
    for name in (
        ".step_00000010.partial",
        ".step_00000025.partial",
        "step_00000005",
        "step_00000010.damaged",
    ):
        (root / name).mkdir(parents=True)
        (root / name / "rank00000.safetensors").write_bytes(b"x")
    removed = remove_unfinished(root)
    assert [p.name for p in removed] == [".step_00000010.partial", ".step_00000025.partial"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000005", "step_00000010.damaged"]
    assert remove_unfinished(tmp_path / "none") == []  # no directory: nothing to do
