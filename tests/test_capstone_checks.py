"""The capstone's checks belong to the capstone (distlib/app/observe/summary.py, RunConfig.departures):
a falling loss binds a run with the capstone's model, data and learning, and is a warning line for
a run that changed them; the other invariants fail any run. MFU's peak: a data-sheet table for
known GPUs, a key, or measured, and the run says which."""

import pytest
import torch
from e2e import train as train_script
from trainrun import compose_tree

from distlib.app.config.run import RunConfig
from distlib.app.observe import summary, throughput
from distlib.app.observe.results import RunResult, StepLog
from distlib.comm.group import Comm


@pytest.mark.parametrize(
    "overrides, departures",
    [
        ([], []),
        (["dist.world_size=2", "zero=stage3", "train.grad_accum=2", "checkpoint.every_steps=5"], []),
        (["model.dropout=0.1", "optimizer.lr=0.002"], ["model.dropout", "optimizer.lr"]),
        (["seed=7", "train.dtype=bf16"], ["train.dtype", "seed"]),
        (["model=gpt2"], ["model.family"]),
    ],
)
def test_departures_name_the_capstone_deciding_keys_a_run_changes(overrides, departures):
    assert RunConfig.from_dict(compose_tree(overrides)).departures() == departures


RISING = RunResult(0, [StepLog(1, 3.0, 0.5, [1.0], 0.01), StepLog(2, 3.5, 0.5, [1.0], 0.01)])


def test_a_rising_loss_fails_the_capstone_and_warns_elsewhere():
    failures = summary.check_invariants(RISING, 0.0, 20)
    assert failures == ["invariant 1 (monotone loss): step 2 loss 3.5 > step 1 loss 3.0"]
    assert summary.loss_warning(RISING, 0.0, 20, []) is None
    assert summary.check_invariants(RISING, 0.0, 20, ["optimizer.lr"]) == []
    assert summary.loss_warning(RISING, 0.0, 20, ["optimizer.lr"]) == (
        "warning: the loss rose: step 2 loss 3.5 > step 1 loss 3.0 (invariant 1 binds the capstone's "
        "model, data and learning rate; this run sets optimizer.lr)"
    )


def test_other_invariants_fail_any_run():
    split = RunResult(0, [StepLog(1, 3.0, 0.5, [1.0, 1.5], 0.01)])
    assert summary.check_invariants(split, 0.0, 20, ["optimizer.lr"])[0].startswith("invariant 2")


def test_a_changed_run_whose_loss_rises_warns_and_succeeds(tmp_path):
    # the command (shortened): it used to train, then exit 1 on invariant 1
    proc = train_script(tmp_path, "train.steps=16", "model.dropout=0.1", "optimizer.lr=0.002", timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "INVARIANT FAILED" not in proc.stderr
    assert "warning: the loss rose: step 14 loss" in proc.stderr
    assert "this run sets model.dropout, optimizer.lr)" in proc.stderr


def test_the_capstone_whose_loss_rises_fails(tmp_path):
    # the capstone's math with a learning-rate fault and no guard to roll it back: invariant 1 fails it
    proc = train_script(
        tmp_path,
        "dist.world_size=2",
        "guard.enabled=false",
        "fault.lr_spike_step=5",
        "fault.lr_spike_factor=300",
    )
    assert proc.returncode != 0
    assert "INVARIANT FAILED: invariant 1 (monotone loss)" in proc.stderr
    assert "RESUME VERIFIED" in proc.stdout  # the other invariants still hold and are still checked
    assert "[mfu_peak] step 0: MFU's peak " in proc.stdout
    assert "for the job (measured: the best of 8 256x256 fp32 matmuls)" in proc.stdout


def test_mfu_peak_comes_from_the_key_the_table_or_a_measurement(monkeypatch):
    world = Comm(ranks=(0, 1, 2, 3), rank=0)
    assert throughput.job_peak(world, torch.device("cpu"), "fp32", 2e12) == (
        8e12,
        "metrics.peak_flops=2e+12 per rank",
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert throughput.known_peak(torch.device("cuda:0"), "bf16") == (
        989e12,
        "NVIDIA H200: data sheet, dense bf16",
    )
    assert throughput.job_peak(world, torch.device("cuda:0"), "fp32", None) == (
        4 * 67e12,
        "NVIDIA H200: data sheet, dense fp32",
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert throughput.known_peak(torch.device("cuda:0"), "bf16")[0] == 756e12
    assert throughput.known_peak(torch.device("cpu"), "bf16") is None


@pytest.mark.parametrize(
    "overrides, on",
    [
        ([], True),
        (["dist.world_size=2", "zero=stage3"], True),
        (["model=llama"], False),
        (["model=llama", "checkpoint.verify_resume=true"], True),
        (["checkpoint.verify_resume=false"], False),
    ],
)
def test_the_resume_check_is_the_capstones_and_opt_in_elsewhere(overrides, on):
    assert RunConfig.from_dict(compose_tree(overrides)).verifies_resume is on


def test_a_run_that_changed_the_capstone_skips_the_resume_check_and_says_how_to_have_it(tmp_path):
    proc = train_script(
        tmp_path, "dist.world_size=2", "model=llama", "train.steps=4", "checkpoint.every_steps=2", timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RESUME VERIFIED" not in proc.stdout
    assert "resume check: not run (no checkpoint saved, or off: checkpoint.verify_resume=true" in proc.stdout
