"""Faults injected into real multi-rank training runs (Trainer on forked gloo ranks), each
showing its documented outcome: rollback with bitwise recovery, the rollback limit, a
pre-emption that reaches one rank, rank 0's checkpoint clock, desync detection, metrics."""

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest
from multiproc import run_ranks
from trainrun import small_tree

from distlib.app.config.run import RunConfig
from distlib.app.runtime.faults import step_hooks
from distlib.app.trainer import Trainer
from distlib.app.unattended.guard import DesyncError, GuardError
from distlib.app.unattended.stopping import StopSignals
from distlib.checkpoint import sharded as checkpoint


def config(**groups) -> dict:
    return small_tree(12, 5, **groups)


class StepClock:
    """A fake clock: each reading advances it by ``step_s`` (0: time stands still)."""

    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def _train(comm, tree, run_dir, clocks=None):
    cfg = RunConfig.from_dict(tree)
    clock = StepClock(clocks[comm.rank]) if clocks else None
    try:
        trainer = Trainer(cfg, comm, Path(run_dir), clock=clock, hooks=step_hooks(cfg.fault, comm.rank))
        result = trainer.run()
    except (GuardError, DesyncError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "losses": {s.step: s.loss.hex() for s in result.steps},
        "params": hashlib.sha256(trainer.optimizer.full_params().numpy().tobytes()).hexdigest(),
        "rollbacks": result.rollbacks,
        "saved": [m["step"] for m in result.manifests],
        "stopped_by": result.stopped_by,
        "resume_ok": result.resume_check.ok if result.resume_check else None,
    }


def train(tree, run_dir, clocks=None) -> list[dict]:
    return run_ranks(_train, tree["dist"]["world_size"], tree, str(run_dir), clocks)


def events(run_dir, name=None) -> list[dict]:
    records = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    return [r for r in records if r["type"] == "event" and (name is None or r["event"] == name)]


def manifest_hashes(run_dir, step) -> list[str]:
    manifest = checkpoint.read_manifest(Path(run_dir) / "checkpoints" / checkpoint.step_dir_name(step))
    return [f["sha256"] for f in manifest["files"]]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("clean")
    return run_dir, train(config(), run_dir)


# --------------------------------------------------------------------------- rollback


def test_clean_run_never_trips_the_default_guard(clean):
    run_dir, results = clean
    assert results[0]["rollbacks"] == [] and results[0]["saved"] == [5, 10]
    assert results[0]["resume_ok"] is True
    assert not events(run_dir, "rollback")


def test_lr_spike_at_a_checkpoint_step_rolls_back_past_that_checkpoint_and_recovers_bitwise(clean, tmp_path):
    # The spiked update at step 5 is saved by the step-5 checkpoint; it shows in step 6's loss,
    # so that checkpoint was never trusted and the run returns to its starting state in memory.
    results = train(config(fault={"lr_spike_step": 5, "lr_spike_factor": 100.0}), tmp_path)
    assert results[0] == results[1]
    (rollback,) = results[0]["rollbacks"]
    assert rollback["step"] == 6 and rollback["to_step"] == 0 and "loss spike" in rollback["reason"]
    assert rollback["source"] == "the step-0 state kept in memory"
    assert rollback["distrusted"].endswith("step_00000005")
    (aside,) = rollback["set_aside"]
    assert aside.endswith("rolled_back_1/step_00000005") and Path(aside, "manifest.json").is_file()
    clean_dir, clean_results = clean
    assert results[0]["losses"] == clean_results[0]["losses"]  # all 12 steps, bit for bit
    assert results[0]["params"] == clean_results[0]["params"]
    for step in (5, 10):  # the re-saved checkpoints are the clean run's, byte for byte
        assert manifest_hashes(tmp_path, step) == manifest_hashes(clean_dir, step)
    bad = [f["sha256"] for f in json.loads(Path(aside, "manifest.json").read_text())["files"]]
    assert bad != manifest_hashes(clean_dir, 5)
    assert results[0]["resume_ok"] is True
    (event,) = events(tmp_path, "rollback")
    assert event["to_step"] == 0 and event["step"] == 6


def test_lr_spike_after_a_trusted_checkpoint_rolls_back_to_it(clean, tmp_path):
    results = train(config(fault={"lr_spike_step": 7, "lr_spike_factor": 100.0}), tmp_path)
    (rollback,) = results[0]["rollbacks"]
    assert rollback["step"] == 8 and rollback["to_step"] == 5
    assert rollback["source"].endswith("checkpoints/step_00000005") and rollback["set_aside"] == []
    assert results[0]["losses"] == clean[1][0]["losses"]
    assert results[0]["params"] == clean[1][0]["params"]


def test_nan_gradient_on_one_rank_is_caught_before_the_update(clean, tmp_path):
    results = train(config(fault={"nan_grad_rank": 1, "nan_grad_step": 7}), tmp_path)
    assert results[0]["rollbacks"] == results[1]["rollbacks"]
    (rollback,) = results[0]["rollbacks"]
    assert rollback["step"] == 7 and rollback["to_step"] == 5
    assert "non-finite gradient norm" in rollback["reason"]
    assert results[0]["losses"] == clean[1][0]["losses"]
    assert results[0]["params"] == clean[1][0]["params"]


def test_keep_last_never_deletes_the_checkpoint_a_rollback_needs(clean, tmp_path):
    # The spiked step-4 update is saved at step 4; pruning right after that save (keep_last=1)
    # would delete step 2, the only trusted target. Retention waits until a checkpoint is trusted.
    results = train(
        config(
            checkpoint={"every_steps": 2, "keep_last": 1},
            fault={"lr_spike_step": 4, "lr_spike_factor": 100.0},
        ),
        tmp_path,
    )
    (rollback,) = results[0]["rollbacks"]
    assert rollback["step"] == 5 and rollback["to_step"] == 2 and rollback["source"].endswith("step_00000002")
    assert results[0]["losses"] == clean[1][0]["losses"] and results[0]["params"] == clean[1][0]["params"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["rolled_back_1", "step_00000012"]


def test_skipped_batches_are_part_of_the_checkpointed_data_position(clean, tmp_path):
    faulty = tmp_path / "faulty"
    results = train(
        config(fault={"lr_spike_step": 7, "lr_spike_factor": 100.0}, guard={"skip_batches": 3}), faulty
    )
    (rollback,) = results[0]["rollbacks"]
    assert rollback["to_step"] == 5 and rollback["skipped_batches"] == 3
    losses, clean_losses = results[0]["losses"], clean[1][0]["losses"]
    assert [losses[s] for s in range(1, 6)] == [clean_losses[s] for s in range(1, 6)]
    assert losses[6] != clean_losses[6]  # step 6 now trains on batch 9
    _, rank_state = checkpoint.load_shard(faulty / "checkpoints" / "step_00000010", 0)
    assert rank_state["skipped_batches"] == 3
    assert rank_state["data"]["next_sample"] == (10 + 3) * rank_state["data"]["global_batch"]
    # Resuming from it continues on the same (skipped) data: exactly the faulty run's last steps.
    resumed = train(
        config(checkpoint={"resume": str(faulty / "checkpoints" / "step_00000010")}), tmp_path / "resumed"
    )
    assert resumed[0]["losses"] == {s: losses[s] for s in (11, 12)}


def test_after_max_rollbacks_trips_the_run_stops_with_an_error(tmp_path):
    results = train(
        config(
            fault={"lr_spike_step": 3, "lr_spike_factor": 100.0, "nan_grad_rank": 0, "nan_grad_step": 9},
            guard={"max_rollbacks": 1},
        ),
        tmp_path,
    )
    assert results[0] == results[1]
    error = results[0]["error"]
    assert error.startswith("GuardError: guard tripped at step 9 (non-finite gradient norm")
    assert "trip 2, more than guard.max_rollbacks=1" in error
    assert [e["event"] for e in events(tmp_path) if e["event"] in ("rollback", "guard_stop")] == [
        "rollback",
        "guard_stop",
    ]


def test_max_rollbacks_zero_stops_at_the_first_trip(tmp_path):
    results = train(
        config(fault={"lr_spike_step": 3, "lr_spike_factor": 100.0}, guard={"max_rollbacks": 0}), tmp_path
    )
    assert results[0]["error"].startswith("GuardError: guard tripped at step 4 (loss spike")


# --------------------------------------------------------------------------- pre-emption


def test_sigterm_reaching_one_rank_stops_every_rank_after_saving_the_same_step(clean, tmp_path):
    results = train(config(fault={"sigterm_rank": 1, "sigterm_step": 4}), tmp_path)
    for r in results:
        assert r["stopped_by"] == "SIGTERM" and r["saved"] == [4] and max(r["losses"]) == 4
    (saved,) = events(tmp_path, "checkpoint_saved")
    assert saved["reason"] == "signal" and saved["step"] == 4
    assert events(tmp_path, "preempted")[0]["signal"] == "SIGTERM"
    checkpoint.verify(tmp_path / "checkpoints" / "step_00000004")
    # The saved state continues exactly like the run that was never interrupted.
    resumed = train(config(checkpoint={"resume": "latest"}), tmp_path)
    assert resumed[0]["losses"] == {s: h for s, h in clean[1][0]["losses"].items() if s > 4}
    assert resumed[0]["params"] == clean[1][0]["params"]


def _stop_signals(comm, signum):
    # (the handler before, not a default: a job started in the background has SIGINT ignored)
    before = signal.getsignal(signum)
    with StopSignals() as signals:
        assert signals.received == 0 and signal.getsignal(signum) != before
        os.kill(os.getpid(), signum)
        got = signals.received
    return got, signal.getsignal(signum) == before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2])
def test_stop_signals_record_the_signal_and_restore_the_handlers(signum):
    got, restored = run_ranks(_stop_signals, 1, signum)[0]
    assert got == signum and restored


# --------------------------------------------------------------------------- checkpoint clock


def _due_steps(steps: int, tick_s: float, every_s: float) -> list[int]:
    """The steps after which a save is due on a clock that advances ``tick_s`` per reading, read once
    at start (the first "last save"), once per step (due when ``every_s`` have passed since the last
    save) and once per save (the new last save)."""
    now = last = tick_s
    due = []
    for step in range(1, steps + 1):
        now += tick_s
        if now - last >= every_s:
            due.append(step)
            now += tick_s
            last = now
    return due


@pytest.mark.parametrize(
    "dist, train_cfg, clocks",
    [
        ({"world_size": 3}, {}, [25.0, 1e6, 0.0]),
        # two pipeline stages (1F1B, 2 micro-batches): rank 1 holds the last stage and its own clock
        ({"world_size": 2, "pp": 2}, {"grad_accum": 2}, [25.0, 1e6]),
    ],
    ids=["dp3", "pp2"],
)
def test_rank0s_clock_alone_decides_time_based_checkpoints(tmp_path, dist, train_cfg, clocks):
    # Rank 0's clock advances 25 s per reading (a reading at start, one per step, one per save);
    # rank 1's clock always says a save is overdue, rank 2's never moves. Were their clocks used,
    # the ranks would disagree and the collective save could not complete.
    tree = config(
        dist=dist,
        checkpoint={"every_steps": 0, "every_minutes": 1.0},
        train={"steps": 9, "global_batch": 12, **train_cfg},
    )
    results = train(tree, tmp_path, clocks=clocks)
    assert all(r["saved"] == results[0]["saved"] for r in results)
    saved = results[0]["saved"]
    assert saved == _due_steps(9, clocks[0], 60.0), saved
    reasons = {e["reason"] for e in events(tmp_path, "checkpoint_saved")}
    assert reasons == {"every_minutes"}
    assert sorted(int(p.name[5:]) for p in (tmp_path / "checkpoints").glob("step_*")) == saved


# --------------------------------------------------------------------------- desync


@pytest.mark.parametrize("stage, perturb_step, every, caught_at", [(1, 4, 2, 4), (0, 3, 5, 5)])
def test_a_perturbed_replica_is_named_by_rank_and_parameter(tmp_path, stage, perturb_step, every, caught_at):
    tree = config(
        zero={"stage": stage},
        guard={"check_sync_every": every},
        fault={"perturb_rank": 1, "perturb_step": perturb_step, "perturb_param": "blocks.1.mlp.fc.weight"},
    )
    results = train(tree, tmp_path)
    assert results[0] == results[1]
    assert results[0]["error"] == (
        f"DesyncError: desync at step {caught_at}: replicated parameters are not "
        f"byte-identical across 2 ranks: rank 1 differs in 1 of 30 parameter(s): "
        f"blocks.1.mlp.fc.weight"
    )
    (event,) = events(tmp_path, "desync")
    assert event["step"] == caught_at


# --------------------------------------------------------------------------- metrics


def test_metrics_jsonl_follows_the_documented_schema(tmp_path):
    tree = config(dist={"world_size": 3}, train={"steps": 6, "global_batch": 12}, metrics={"per_rank": True})
    train(tree, tmp_path)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    per_rank = [[json.loads(line) for line in open(tmp_path / f"metrics.rank{r}.jsonl")] for r in range(3)]
    for i, rec in enumerate(steps):
        assert float.fromhex(rec["loss_hex"]) == rec["loss"]
        assert rec["tokens"] == 12 * 16 and rec["tokens_per_s"] == pytest.approx(
            rec["tokens"] / rec["step_time_s"]
        )
        assert rec["lr"] == 0.01 and rec["grad_norm"] > 0 and rec["param_norm"] > 0
        own = [rows[i] for rows in per_rank]
        assert [o["step"] for o in own] == [rec["step"]] * 3
        assert rec["step_time_s"] == own[0]["step_time_s"]
        assert rec["step_time_s_max"] == max(o["step_time_s"] for o in own)
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "peak_rss_bytes"):
            values = [o[key] for o in own]
            assert rec["memory"][key] == {"max": max(values), "mean": pytest.approx(sum(values) / 3)}
        # ZeRO-1: one reduce-scatter of the gradients per step, sending (N-1)/N of them.
        grads = rec["memory"]["grads_bytes"]["max"]
        rs = rec["comm"]["reduce_scatter"]
        assert rs["calls"] == 1 and rs["bytes"]["max"] >= 2 * grads // 3 and rs["seconds"]["max"] > 0
        for kind, entry in rec["comm"].items():
            assert entry["bytes"]["max"] == max(
                o["comm"].get(kind, {"bytes": {"max": 0}})["bytes"]["max"] for o in own
            )
    names = [r["event"] for r in records if r["type"] == "event"]
    assert names[0] == "run_start" and names[-1] == "run_end" and "checkpoint_saved" in names
    memory = [r for r in records if r.get("event") == "memory"]
    assert [len(m["per_rank"]) for m in memory] == [3, 3]
    assert events(tmp_path, "run_end")[0]["status"] == "completed"


# --------------------------------------------------------------------------- configuration


def test_the_composed_defaults_leave_every_fault_off_and_the_guard_on():
    from distlib.launch.hydra_config import compose_tree

    cfg = RunConfig.from_dict(compose_tree([]))
    assert cfg == RunConfig()  # conf/ adds nothing to the dataclasses' defaults
    assert cfg.checkpoint.every_minutes == 30 and cfg.guard.enabled and cfg.dist.check_collectives
    assert not cfg.fault.configured and all(v is None for v in cfg.fault.to_dict().values())


@pytest.mark.parametrize(
    "group, values, message",
    [
        ("guard", {"spike_factor": 1.0}, "guard.spike_factor must be a number > 1"),
        ("guard", {"spike_window": 0}, "guard.spike_window must be an integer >= 1"),
        ("guard", {"max_rollbacks": -1}, "guard.max_rollbacks must be an integer >= 0"),
        ("checkpoint", {"every_minutes": -1}, "checkpoint.every_minutes must be a number >= 0"),
        ("fault", {"lr_spike_step": 3}, "fault.lr_spike_step and fault.lr_spike_factor must be set together"),
        ("fault", {"hang_rank": 1}, "fault.hang_rank and fault.hang_step must be set together"),
        (
            "fault",
            {"nan_grad_rank": 2, "nan_grad_step": 3},
            "fault.nan_grad_rank=2 is not a rank of dist.world_size=2",
        ),
        ("fault", {"perturb_rank": 0, "perturb_step": 13}, "fault.perturb_step=13 is beyond train.steps=12"),
        ("fault", {"perturb_param": "x"}, "fault.perturb_param needs fault.perturb_rank"),
        ("metrics", {"file": "a/b.jsonl"}, "metrics.file must be a plain file name"),
        ("guard", {"colour": 1}, "unknown key"),
    ],
)
def test_bad_unattended_settings_are_refused_with_the_key_named(group, values, message):
    from distlib.app.config.run import ConfigError

    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict(config(**{group: values}))


def _bad_param(comm, tree, run_dir):
    try:
        cfg = RunConfig.from_dict(tree)
        Trainer(cfg, comm, Path(run_dir), hooks=step_hooks(cfg.fault, comm.rank))
    except ValueError as exc:
        return str(exc)


def test_an_unknown_parameter_to_perturb_fails_before_training(tmp_path):
    tree = config(fault={"perturb_rank": 0, "perturb_step": 2, "perturb_param": "nope"})
    assert "fault.perturb_param='nope' is not a parameter" in run_ranks(_bad_param, 2, tree, str(tmp_path))[0]
