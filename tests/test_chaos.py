"""A seeded kill loop: SIGKILLs of random ranks (rank 0 included) at random moments -- inside a step,
inside a disk save, inside a snapshot round -- and the job still finishes with its final checkpoint
byte-identical to an uninterrupted run's, no recorded step run again (every step in metrics.jsonl
once), and nothing left in /dev/shm (benchmarks/chaos.py, small): under torchrun --max-restarts
(2 ranks, 3 kills), and under python train.py dist.max_restarts, where only the lost worker is
replaced (4 ranks, 5 kills), there also by a standby started beforehand (dist.standbys=1)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import chaos  # noqa: E402


def _brief(kills: list[dict]) -> list[tuple]:
    """A failure's kills, short enough that pytest does not cut the one that failed."""
    return [(k["rank"], k["moment"], k["steps_lost"], round(k["t"], 3)) for k in kills]


def _step(step: int, t: float) -> dict:
    return {"type": "step", "step": step, "time": t}


def _restart(step: int, t: float) -> dict:
    return {"type": "event", "event": "restart", "step": step, "time": t}


def test_steps_lost_counts_recorded_steps_the_restart_runs_again_and_never_goes_below_zero():
    before = [_step(1, 1.0), _step(2, 2.0), _step(3, 3.0)]
    # the kill at 3.5, after step 3's record: a restart from step 3 loses none, from 1 loses two
    assert chaos.steps_lost([*before, _restart(3, 4.0), _step(4, 4.5)], 3.5) == 0
    assert chaos.steps_lost([*before, _restart(1, 4.0), _step(2, 4.5)], 3.5) == 2
    # rank 0 recorded step 3 only after the kill was timed (it lagged, or the signal came late),
    # and the snapshot of step 3 was whole: the restart runs no step again
    assert chaos.steps_lost([*before[:2], _step(3, 3.6), _restart(3, 4.0)], 3.5) == 0
    # the next restart is the one after the kill, not an earlier one
    assert chaos.steps_lost([_restart(0, 0.5), *before, _restart(2, 4.0)], 3.5) == 1


@pytest.mark.slow
def test_three_kills_at_random_moments_redo_no_step_and_change_no_byte(tmp_path):
    result = chaos.run(tmp_path, kills=3, world_size=2, seed=1)
    assert result["exit_code"] == 0, result["stderr_tail"]
    kills = result["kills"]
    assert [k["moment"] for k in kills] == ["step", "save", "snapshot"], kills  # each moment was caught
    assert 0 in {k["rank"] for k in kills}
    assert all(k["steps_lost"] == 0 for k in kills), _brief(kills)  # no recorded step is run again
    assert result["steps_unrecorded"] == [] and result["records_repeated"] == 0
    assert result["byte_identical"] and result["shm_clean"] and result["partials_left"] == []


KILLS = 5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run the own launcher's five-kill loops end equal to (one, for both)."""
    return chaos.reference_run(tmp_path_factory.mktemp("reference"), KILLS, 4)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["own", "standby"])
def test_five_kills_under_the_own_launcher_replace_the_lost_worker_alone_and_change_no_byte(
    tmp_path, reference, launcher
):
    kills = KILLS
    result = chaos.run(tmp_path, kills=kills, world_size=4, seed=1, launcher=launcher, reference=reference)
    assert result["exit_code"] == 0, result["stderr_tail"]
    rows = result["kills"]
    assert [k["moment"] for k in rows] == ["step", "save", "snapshot", "step", "save"], rows
    assert 0 in {k["rank"] for k in rows}
    assert all(k["steps_lost"] == 0 for k in rows), _brief(rows)
    assert result["steps_unrecorded"] == [] and result["records_repeated"] == 0
    assert result["byte_identical"] and result["shm_clean"] and result["partials_left"] == []
    # one new worker per kill: the survivors kept theirs (torchrun would start 4 per kill)
    assert result["worker_processes"] == 4 + kills, result["worker_processes"]
    # with dist.standbys=1 each new worker was a standby waiting before its kill; without, none was
    assert [k["from_standby"] for k in rows] == [launcher == "standby"] * kills, _brief(rows)


@pytest.mark.slow
def test_kills_inside_a_step_and_an_async_save_under_the_own_launcher_change_no_byte(tmp_path):
    # the survivors' background writer of the interrupted save runs on beside the next generation
    result = chaos.run(
        tmp_path, kills=2, world_size=4, seed=1, launcher="own", extra=("checkpoint.async_save=true",)
    )
    assert result["exit_code"] == 0, result["stderr_tail"]
    assert [k["moment"] for k in result["kills"]] == ["step", "save"], result["kills"]
    assert all(k["steps_lost"] == 0 for k in result["kills"]), _brief(result["kills"])
    assert result["steps_unrecorded"] == [] and result["records_repeated"] == 0
    assert result["byte_identical"] and result["shm_clean"] and result["partials_left"] == []
