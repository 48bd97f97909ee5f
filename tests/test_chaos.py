"""A seeded kill loop: SIGKILLs of random ranks (rank 0 included) at random moments -- inside a step,
inside a disk save, inside a snapshot round -- and the job still finishes with its final checkpoint
byte-identical to an uninterrupted run's, no recorded step run again (every step in metrics.jsonl
once), and nothing left in /dev/shm (benchmarks/chaos.py, small): under torchrun --max-restarts
(2 ranks, 3 kills), and under python train.py dist.max_restarts, where only the lost worker is
replaced (4 ranks, 5 kills)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import chaos  # noqa: E402

pytestmark = pytest.mark.slow


def test_three_kills_at_random_moments_redo_no_step_and_change_no_byte(tmp_path):
    result = chaos.run(tmp_path, kills=3, world_size=2, seed=1)
    assert result["exit_code"] == 0, result["stderr_tail"]
    kills = result["kills"]
    assert [k["moment"] for k in kills] == ["step", "save", "snapshot"], kills  # each moment was caught
    assert 0 in {k["rank"] for k in kills}
    assert all(k["steps_lost"] == 0 for k in kills), kills  # no recorded step is run again
    assert result["steps_unrecorded"] == [] and result["records_repeated"] == 0
    assert result["byte_identical"] and result["shm_clean"]


def test_five_kills_under_the_own_launcher_replace_the_lost_worker_alone_and_change_no_byte(tmp_path):
    kills = 5
    result = chaos.run(tmp_path, kills=kills, world_size=4, seed=1, launcher="own")
    assert result["exit_code"] == 0, result["stderr_tail"]
    rows = result["kills"]
    assert [k["moment"] for k in rows] == ["step", "save", "snapshot", "step", "save"], rows
    assert 0 in {k["rank"] for k in rows}
    assert all(k["steps_lost"] == 0 for k in rows), rows
    assert result["steps_unrecorded"] == [] and result["records_repeated"] == 0
    assert result["byte_identical"] and result["shm_clean"]
    # one new process per kill: the survivors kept theirs (torchrun would start 4 per kill)
    assert result["worker_processes"] == 4 + kills, result["worker_processes"]


def test_kills_inside_a_step_and_an_async_save_under_the_own_launcher_change_no_byte(tmp_path):
    # the survivors' background writer of the interrupted save runs on beside the next generation
    result = chaos.run(
        tmp_path, kills=2, world_size=4, seed=1, launcher="own", extra=("checkpoint.async_save=true",)
    )
    assert result["exit_code"] == 0, result["stderr_tail"]
    assert [k["moment"] for k in result["kills"]] == ["step", "save"], result["kills"]
    assert all(k["steps_lost"] == 0 for k in result["kills"]), result["kills"]
    assert result["steps_unrecorded"] == [] and result["records_repeated"] == 0
    assert result["byte_identical"] and result["shm_clean"]
