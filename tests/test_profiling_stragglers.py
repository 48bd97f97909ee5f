"""train.profile_steps (Chrome traces with every collective named), scripts/report.py's time split,
the straggler record and event (fault.slow_rank slows one rank on purpose), and MFU."""

import importlib.util
import itertools
import json
import math
import re
import types
from pathlib import Path

import pytest
import torch
from forkrun import run_script
from multiproc import run_ranks

from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.model.minigpt import build_model
from distlib.app.observe import throughput
from distlib.app.observe.stragglers import Slowest, StragglerWatch, slowest
from distlib.app.runtime.faults import step_hooks
from distlib.app.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
SLEEP = 0.3  # well above the forward/backward time, which varies by tens of ms on a loaded machine


def _train(comm, tree, run_dir):
    cfg = RunConfig.from_dict(tree)
    Trainer(cfg, comm, Path(run_dir), hooks=step_hooks(cfg.fault, comm.rank)).run()


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("slow")
    tree = {
        "dist": {"world_size": 3},
        "train": {"steps": 5, "global_batch": 12, "profile_steps": [2, 3]},
        "checkpoint": {"every_steps": 0},
        "metrics": {"progress_every": 0},
        "guard": {"straggler_window": 3},
        "fault": {"slow_rank": 1, "slow_seconds": SLEEP},
    }
    run_ranks(_train, 3, tree, str(run_dir))
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return run_dir, records


def test_a_slowed_rank_is_named_slowest_every_step_and_a_straggler_once(slow_run):
    _, records = slow_run
    steps = [r for r in records if r["type"] == "step"]
    assert [r["slowest"]["rank"] for r in steps] == [1] * 5
    for r in steps:
        slow = r["slowest"]
        assert slow["lag_s"] == pytest.approx(slow["busy_s"] - slow["median_busy_s"])
        assert slow["lag_s"] > 0.5 * SLEEP and slow["ratio"] > 1.5
    events = [r for r in records if r.get("event") == "straggler"]
    assert [(e["step"], e["rank"], e["steps"]) for e in events] == [(3, 1, 3)]


def test_mfu_is_6_p_tokens_over_step_time_and_the_peak_measured_once(slow_run):
    _, records = slow_run
    cfg = RunConfig().model  # the run's model: slow_run leaves the model group at its defaults
    params = sum(p.numel() for p in build_model(cfg, seed=0).parameters())  # counted, not the formula
    tokens = 12 * cfg.seq_len  # train.global_batch sequences of seq_len tokens
    steps = [r for r in records if r["type"] == "step"]
    peaks = {r["peak_flops"] for r in steps}
    assert len(peaks) == 1 and 0 < peaks.pop() < math.inf, "one peak, measured at start"
    for r in steps:
        assert r["tokens"] == tokens
        achieved = 6 * params * tokens / r["step_time_s"]  # attention's score arithmetic left out
        assert r["mfu"] == pytest.approx(achieved / r["peak_flops"], rel=1e-12)
        assert r["mfu"] < 1  # SLEEP alone keeps a step far from the machine's peak


def _probe_on_a_fake_clock(comm):
    """peak_flops on a clock that advances 2^-(10 + rank) s per reading: each timed matmul takes
    exactly that long (the powers of two keep the differences exact)."""
    readings = itertools.count(0.0, 2.0 ** -(10 + comm.rank))
    throughput.time = types.SimpleNamespace(perf_counter=lambda: next(readings))  # this fork's module
    return throughput.peak_flops(comm, torch.device("cpu"))


def test_the_peak_is_every_ranks_256_cubed_matmul_rate_summed():
    expected = sum(2 * 256**3 / 2.0 ** -(10 + rank) for rank in range(3))
    assert run_ranks(_probe_on_a_fake_clock, 3) == [expected] * 3


def _probes_of_two_generations_and_another_process(comm):
    calls = []

    def counted(device):
        calls.append(device)
        return 1e9

    throughput.probe_flops = counted  # this fork's module
    peaks = [throughput.peak_flops(comm, torch.device("cpu")) for _ in range(2)]
    probes_here = len(calls)
    throughput.os = types.SimpleNamespace(getpid=lambda: -1)  # as another process would see it
    throughput.probed(torch.device("cpu"))
    return peaks, probes_here, len(calls)


def test_a_rank_that_stays_keeps_its_probe_and_another_process_probes_again():
    [(peaks, probes_here, probes_in_all)] = run_ranks(_probes_of_two_generations_and_another_process, 1)
    assert peaks == [1e9, 1e9] and probes_here == 1 and probes_in_all == 2


def test_profiled_steps_leave_one_trace_per_rank_with_named_collectives(slow_run):
    run_dir, _ = slow_run
    for rank in range(3):
        events = json.loads((run_dir / "traces" / f"rank{rank}.json").read_text())["traceEvents"]
        names = [e["name"] for e in events if e.get("ph") == "X"]
        assert sorted(n for n in names if n.startswith("step ")) == ["step 2", "step 3"]
        collectives = [n for n in names if n.startswith("collective:")]
        assert collectives and all(
            re.fullmatch(r"collective:\w+ algo=\w+( bytes=\d+)?", n) for n in collectives
        )
        assert any(n.startswith("collective:reduce_scatter algo=") and "bytes=" in n for n in collectives)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_report_splits_each_ranks_time_and_the_others_wait_for_the_slow_one(slow_run, tmp_path):
    run_dir, _ = slow_run
    proc = run_script("scripts/report.py", str(run_dir), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = {
        int(m[0]): tuple(map(float, m[1:]))
        for m in re.findall(
            r"rank (\d+): compute +([\d.]+) ms +communication +([\d.]+) ms +waiting +([\d.]+) ms", proc.stdout
        )
    }
    assert sorted(rows) == [0, 1, 2]
    # Two profiled steps of a SLEEP on rank 1: its compute holds them, the others wait them out.
    assert rows[1][0] > 2 * 1000 * SLEEP * 0.5
    for fast in (0, 2):
        assert rows[fast][2] > 2 * 1000 * SLEEP * 0.5 > rows[1][2]
    assert (tmp_path / "time_split.png").stat().st_size > 0


def test_the_straggler_streak_needs_the_same_rank_over_the_factor_in_a_row():
    watch = StragglerWatch(factor=1.5, window=2)
    seen = [
        watch.update(Slowest(rank, busy, 1.0))
        for rank, busy in [(1, 2.0), (2, 2.0), (2, 1.4), (2, 2.0), (2, 2.0), (2, 2.0)]
    ]
    assert seen == [False, False, False, False, True, False]
    assert slowest([0.1, 0.3, 0.3, 0.2]) == Slowest(1, 0.3, 0.25)


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"train": {"profile_steps": [3, 2]}}, "train.profile_steps must be"),
        ({"train": {"profile_steps": [1, 21]}}, "train.profile_steps must be"),
        ({"train": {"profile_steps": 4}}, "train.profile_steps must be"),
        ({"fault": {"slow_rank": 1}}, "fault.slow_rank and fault.slow_seconds"),
        ({"fault": {"slow_rank": 9, "slow_seconds": 0.1}}, "fault.slow_rank=9 is not a rank"),
        ({"guard": {"straggler_factor": 1.0}}, "guard.straggler_factor must be a number > 1"),
        ({"guard": {"straggler_window": 0}}, "guard.straggler_window must be an integer >= 1"),
    ],
)
def test_bad_values_name_the_key(tree, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict(tree)
