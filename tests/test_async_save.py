"""checkpoint.async_save writes in a background thread and commits at a later step boundary: the
same bytes as a sync save; a failed or crashed background write commits nothing and leaves the
previous checkpoint trusted; and the loop waits less than the write takes."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from ckpt_util import (
    OPTIMIZER_STATE,
    assert_files_match_manifest,
    assert_same_state,
    saved_state,
    train,
    train_rank,
    tree,
)
from multiproc import run_ranks

from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.runtime.faults import Faults, step_hooks
from distlib.app.runtime.hooks import StepHooks
from distlib.app.trainer import Trainer
from distlib.checkpoint import sharded as checkpoint

ASYNC = {"async_save": True}


def _committed(run: Path) -> list[str]:
    return [p.name for p in checkpoint.list_committed(run / "checkpoints")]


def _partials(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.endswith(".partial"))


def _file_hashes(run: Path) -> dict[str, str]:
    root = run / "checkpoints"
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def _events(run: Path, name: str) -> list[dict]:
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return [r for r in records if r["type"] == "event" and r["event"] == name]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    """An uninterrupted sync 8-step 2-rank run (checkpoints at 3 and 6)."""
    run = tmp_path_factory.mktemp("sync")
    results = train(tree(2, steps=8), run)
    return {"losses": results[0]["losses"], "params": results[0]["params"], "run": run}


def test_config_rejects_a_non_boolean_async_save():
    with pytest.raises(ConfigError, match="checkpoint.async_save must be true or false"):
        RunConfig.from_dict(tree(2, checkpoint={"async_save": "yes"}))


def test_async_save_writes_the_sync_bytes_and_resumes_bitwise(tmp_path, clean):
    run = tmp_path / "run"
    first = train(tree(2, steps=8, checkpoint={**ASYNC, "verify_resume": True}), run)
    # its reload, checked below from the files: the sync save's bytes, and resumes that are bitwise
    assert all(r["error"] is None for r in first)
    assert first[0]["losses"] == clean["losses"]
    # Every shard and manifest byte-identical to the sync save of the same run.
    hashes = _file_hashes(run)
    assert sorted(hashes) == [
        f"step_0000000{s}/{n}"
        for s in (3, 6)
        for n in ("manifest.json", "rank00000.safetensors", "rank00001.safetensors")
    ]
    assert hashes == _file_hashes(clean["run"])
    saved = _events(run, "checkpoint_saved")
    assert [e["step"] for e in saved] == [3, 6]
    assert all(e["async_save"] and e["committed_step"] > e["step"] for e in saved)

    # Resume from the async-saved step 6: steps 7 and 8 reproduce the uninterrupted run bit for bit.
    (run / "checkpoints" / "step_00000006").rename(tmp_path / "set_aside")  # first from step 3 ...
    resumed = train(tree(2, steps=8, checkpoint={**ASYNC, "resume": "latest"}), run)
    assert resumed[0]["start"] == 3
    assert resumed[0]["losses"] == {s: v for s, v in clean["losses"].items() if s > 3}
    assert (resumed[0]["params"] == clean["params"]).all()
    assert _file_hashes(run) == _file_hashes(clean["run"])  # its own async save of step 6 again
    resumed = train(tree(2, steps=8, checkpoint={**ASYNC, "resume": "latest"}), run)  # ... then from 6
    assert resumed[0]["start"] == 6
    assert resumed[0]["losses"] == {s: v for s, v in clean["losses"].items() if s > 6}
    assert (resumed[0]["params"] == clean["params"]).all()


def test_keep_last_prunes_only_committed_async_saves(tmp_path):
    run = tmp_path / "run"
    results = train(
        tree(2, steps=8, every=2, checkpoint={**ASYNC, "keep_last": 1, "verify_resume": True}), run, True
    )
    assert _committed(run) == ["step_00000008"] and _partials(run) == []  # the end waited for step 8's
    # the one kept (the resume check's) is whole: its files hash to its manifest and hold the final state
    ckpt = run / "checkpoints" / "step_00000008"
    assert_files_match_manifest(ckpt)
    for rank, result in enumerate(results):
        assert_same_state(saved_state(ckpt, rank), result["state"], f"rank {rank}, step 8")


def _rank_with_rollbacks(comm, config: dict, run_dir: str) -> dict:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    cfg = RunConfig.from_dict(config)
    result = Trainer(cfg, comm, Path(run_dir), hooks=step_hooks(cfg.fault, comm.rank)).run()
    return {
        "rollbacks": [(e["to_step"], e["source"]) for e in result.rollbacks],
        "steps": [s.step for s in result.steps],
    }


def test_failed_background_write_is_reported_and_the_previous_checkpoint_stays_trusted(tmp_path, capfd):
    # Rank 1's disk is full in the background write of step 6; the guard then trips at step 8
    # (NaN gradients): the rollback must go to step 3, the newest checkpoint that was committed.
    # The re-run's save of step 6 fails too; step 9's save settles it (a write still in flight at
    # the run's end fails the run, below: with 8 steps a loaded machine's slow write did).
    run = tmp_path / "run"
    config = tree(
        2,
        steps=9,
        checkpoint=ASYNC,
        fault={"disk_full_rank": 1, "save_fault_step": 6, "nan_grad_rank": 0, "nan_grad_step": 8},
    )
    results = run_ranks(_rank_with_rollbacks, 2, config, str(run), timeout_s=60)
    assert results[0]["rollbacks"] == [(3, str(run / "checkpoints" / "step_00000003"))]
    assert results[0]["steps"] == list(range(1, 10))  # the run went on, and re-ran 4..9
    failed = _events(run, "checkpoint_failed")
    assert len(failed) == 2 and {e["checkpoint_step"] for e in failed} == {6}  # (the re-run save of 6 too)
    # reported at a later boundary: the first one after the write failed (step 7, or later when the
    # background write outlasts a step on a loaded machine)
    assert all(e["step"] > 6 for e in failed)
    assert "rank 1 writing" in failed[0]["message"] and "No space left on device" in failed[0]["message"]
    out = capfd.readouterr().out
    said = f"[checkpoint_failed] step {failed[0]['step']}: checkpoint save of step 6 failed"
    assert f"{said}, nothing committed" in out
    assert [e["step"] for e in _events(run, "checkpoint_saved")] == [3, 9]
    assert _committed(run) == ["step_00000003", "step_00000009"] and _partials(run) == []
    checkpoint.verify(run / "checkpoints" / "step_00000003")


def test_failure_of_the_last_background_write_fails_the_run(tmp_path):
    run = tmp_path / "run"
    results = train(
        tree(2, steps=6, checkpoint=ASYNC, fault={"disk_full_rank": 0, "save_fault_step": 6}), run
    )
    assert {r["error"] for r in results} == {
        "checkpoint save of step 6 failed, nothing committed: rank 0 writing "
        f"{run / 'checkpoints' / '.step_00000006.partial' / 'rank00000.safetensors'}"
        ": OSError: [Errno 28] No space left on device (injected by "
        "fault.disk_full_rank)"
    }
    assert _committed(run) == ["step_00000003"] and _partials(run) == []


@pytest.mark.parametrize("point", ["mid_shard", "before_commit"])
def test_crash_in_a_background_save_commits_nothing_and_resume_latest_ignores_it(tmp_path, clean, point):
    # mid_shard: the process dies from the background thread, half-way through its shard.
    run = tmp_path / "run"
    with pytest.raises(AssertionError, match="exited with code -9"):
        train(tree(2, steps=8, checkpoint=ASYNC, fault={"crash_in_save": point, "save_fault_step": 6}), run)
    assert _committed(run) == ["step_00000003"] and _partials(run) == [".step_00000006.partial"]
    resumed = train(tree(2, steps=8, checkpoint={**ASYNC, "resume": "latest"}), run)
    assert resumed[0]["start"] == 3
    assert resumed[0]["losses"] == {s: v for s, v in clean["losses"].items() if s > 3}
    assert _partials(run) == [] and _file_hashes(run) == _file_hashes(clean["run"])


class _SlowDisk(StepHooks):
    """A disk that takes WRITE_S for every shard (in the background write), and steps of STEP_S."""

    WRITE_S, STEP_S = 0.4, 0.15

    def before_step(self, step: int) -> None:
        time.sleep(self.STEP_S)

    def save_hook(self, step: int):
        def hook(point: str, path: Path) -> None:
            if point == "shard_written":
                time.sleep(self.WRITE_S)

        return hook


def _slow_disk_rank(comm, config: dict, run_dir: str) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    Trainer(RunConfig.from_dict(config), comm, Path(run_dir), hooks=_SlowDisk()).run()


def test_async_save_returns_before_writing(tmp_path):
    # "Returns before writing": the loop waits for the copy, the commit and whatever of the write
    # is left when a boundary needs it (here the end of the run, 2 slow steps after the save of 6),
    # never for the whole write. A save that wrote in the loop would wait >= write_s.
    run = tmp_path / "run"
    run_ranks(_slow_disk_rank, 2, tree(2, steps=8, checkpoint=ASYNC), str(run), timeout_s=60)
    saved = _events(run, "checkpoint_saved")
    assert [e["step"] for e in saved] == [3, 6]
    for e in saved:
        assert e["write_s"] >= _SlowDisk.WRITE_S
        assert e["blocking_s"] < e["write_s"] and e["blocking_s"] < e["total_s"], e
    # A sync save blocks for all of it.
    sync = tmp_path / "sync"
    run_ranks(_slow_disk_rank, 2, tree(2, steps=4), str(sync), timeout_s=60)
    (e,) = _events(sync, "checkpoint_saved")
    assert e["blocking_s"] == e["total_s"] >= _SlowDisk.WRITE_S and "write_s" not in e


class _SlowDiskFaults(Faults):
    """The configured faults, on a disk where every shard write takes 1 s (in the background)."""

    def save_hook(self, step: int):
        inner = super().save_hook(step)

        def hook(point: str, path: Path) -> None:
            if point == "shard_written":
                time.sleep(1.0)
            if inner is not None:
                inner(point, path)

        return hook


def _slow_disk_faults_rank(comm, config: dict, run_dir: str) -> dict:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    cfg = RunConfig.from_dict(config)
    result = Trainer(cfg, comm, Path(run_dir), hooks=_SlowDiskFaults(cfg.fault, comm.rank)).run()
    return {"rollbacks": [(e["to_step"], e["source"]) for e in result.rollbacks]}


@pytest.mark.parametrize("trip, to_step", [(4, 0), (5, 3)])
def test_guard_trip_with_an_async_save_in_flight(tmp_path, capfd, trip, to_step):
    # The save of step 3 is still being written when the guard trips. At step 4 (the step that
    # would have made it trusted) it holds the bad update's state: dropped, back to the start.
    # At step 5 step 4 has passed: it is committed first and is the rollback target.
    run = tmp_path / "run"
    config = tree(2, steps=6, checkpoint=ASYNC, fault={"nan_grad_rank": 1, "nan_grad_step": trip})
    results = run_ranks(_slow_disk_faults_rank, 2, config, str(run), timeout_s=60)
    source = str(run / "checkpoints" / "step_00000003") if to_step else "the step-0 state kept in memory"
    assert results[0]["rollbacks"] == [(to_step, source)]
    dropped = "checkpoint: dropped the async save of step 3 (step 4 tripped the guard)"
    assert (dropped in capfd.readouterr().out) == (trip == 4)
    assert _committed(run) == ["step_00000003", "step_00000006"] and _partials(run) == []


def _staging_rank(comm, config: dict, run_dir: str) -> dict:
    """A run that records where every async save's staged optimizer tensors live, and what the
    snapshot the resume check compares with holds when the check begins (step, optimizer state)."""
    from distlib.app.checkpointing.resume_check import ResumeVerifier
    from distlib.checkpoint.staging import StagingBuffers

    staged, stage, kept, verify = [], StagingBuffers.stage, {}, ResumeVerifier.verify

    def recording(self, sources):
        out = stage(self, sources)
        staged.append({k: t.data_ptr() for k, t in out.items()})
        return out

    def keeping(self, build):
        if self.kept is not None:
            state = {k: self.kept.tensors[k].numpy().copy() for k in OPTIMIZER_STATE}
            kept.update(step=self.kept.step, state=state)
        return verify(self, build)

    StagingBuffers.stage, ResumeVerifier.verify = recording, keeping  # (in this forked rank only)
    result = train_rank(comm, config, run_dir)
    return {**result, "staged": staged, "kept": kept}


@pytest.mark.parametrize(
    "verify_resume, keep_last, same",
    [
        (False, 0, [(0, 1)]),  # one set of buffers for both saves
        (True, 0, [(1, 2), (1, 3), (2, 3)]),  # the first save's copy is the snapshot: the rest reuse theirs
        (True, 1, [(0, 2), (1, 3)]),  # each copy is the snapshot until the next commit gives it back
    ],
)
def test_staging_buffers_are_reused_and_every_save_writes_its_own_state(
    tmp_path, clean, verify_resume, keep_last, same
):
    run = tmp_path / "run"
    every = 3 if same == [(0, 1)] else 2
    config = tree(
        2, steps=8, every=every, checkpoint={**ASYNC, "verify_resume": verify_resume, "keep_last": keep_last}
    )
    results = run_ranks(_staging_rank, 2, config, str(run), timeout_s=60)
    ptrs = [p["master"] for p in results[0]["staged"]]
    assert len(ptrs) == (2 if every == 3 else 4)
    pairs = {(i, j) for i in range(len(ptrs)) for j in range(i + 1, len(ptrs)) if ptrs[i] == ptrs[j]}
    assert pairs == set(same)
    assert results[0]["losses"] == clean["losses"]
    if verify_resume:  # the snapshot's copy was never written over: it still holds its step's files
        for rank, result in enumerate(results):
            step = result["kept"]["step"]
            assert step == (8 if keep_last else 2), "the first save, or with keep_last the newest"
            ckpt = run / "checkpoints" / checkpoint.step_dir_name(step)
            assert_same_state(result["kept"]["state"], saved_state(ckpt, rank), f"rank {rank}, step {step}")
    else:  # the second save (into the first one's buffers) wrote step 6's state: the sync bytes
        assert _file_hashes(run) == _file_hashes(clean["run"])
