"""``python train.py dist.max_restarts=K``: a worker lost to a signal is replaced while the other
ranks keep their processes (distlib/launch/agent.py). The kill loop that proves it recovers is in
tests/test_chaos.py; here, a kill while a generation forms (the replacement itself killed), and
what ends such a job: the restarts used up, and the key where another launcher restarts by its own
rules."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from forkrun import run_script

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import chaos  # noqa: E402
from _own_job import OwnJob  # noqa: E402
from _torchrun_job import _alive, _children  # noqa: E402

STEPS = ["train.steps=400", "train.global_batch=12", "checkpoint.memory_every_steps=1"]


@pytest.mark.slow
def test_a_replacement_killed_while_its_generation_forms_is_replaced_again_and_no_byte_changes(tmp_path):
    steps = 25  # the last step is saved (every 5)
    args = chaos.overrides(4, steps, 5)
    reference = OwnJob(tmp_path / "reference", args, 4).start()
    assert reference.finish() == 0, reference.tail()
    # rank 1 joins 1.5 s late at every start: its replacement is killed while the survivors wait
    # for it in the next generation (torch's rendezvous would wait dist.timeout_s for it)
    late = ["fault.late_rank=1", "fault.late_seconds=1.5", "dist.timeout_s=30"]
    job = OwnJob(tmp_path / "run", [*args, *late], 4, max_restarts=2).start()
    job.wait_for(lambda: job.last_step() >= 3, what="step 3")
    first = job.ranks()
    job.kill(first[1])
    job.wait_for(lambda: job.ranks().get(1, first[1]) != first[1], what="the replacement", timeout=30)
    time.sleep(0.8)  # the survivors reach the new generation in ~0.3 s; the replacement is still late
    job.kill(job.ranks()[1])
    assert job.finish(timeout=200) == 0, job.tail()
    assert chaos.final_files(job.run_dir, steps) == chaos.final_files(reference.run_dir, steps)
    assert len(job.seen) == 4 + 2  # the survivors kept their processes through both


@pytest.mark.slow
def test_a_loss_past_the_restarts_ends_the_job_with_each_rank_saying_why(tmp_path):
    job = OwnJob(tmp_path / "run", STEPS, nproc=3, max_restarts=1).start()
    job.wait_for(lambda: job.last_step() >= 2, what="step 2")
    first = job.ranks()
    t_kill = job.kill(first[2])
    job.wait_for(
        lambda: any(r.get("event") == "restart" and r["time"] > t_kill for r in job.records()),
        what="the restart",
    )
    job.wait_for(lambda: job.last_step() >= 5, what="two more steps")
    second = job.ranks()
    # the survivors are the same processes; rank 2 is a new one
    assert {r: second[r] for r in (0, 1)} == {r: first[r] for r in (0, 1)} and second[2] != first[2]
    job.kill(second[0])
    code = job.finish(timeout=120)
    err = job.output()[1].splitlines()
    assert code == 1, err
    assert err[-1] == (
        "error: training failed: rank 0 (killed by SIGKILL); no restart left (dist.max_restarts=1, 1 used)"
    ), err
    assert any(line.startswith("rank 2 was lost (killed by SIGKILL, pid ") for line in err), err
    for rank in (1, 2):  # each survivor names the rank it lost, in its own line
        said = [line for line in err if line.startswith(f"error [rank {rank}]: ")]
        assert len(said) == 1 and "rank(s) [0] did not arrive" in said[0], err
    assert not any("Traceback" in line for line in err), err


def test_a_hung_rank_is_named_by_the_survivors_and_by_the_launcher(tmp_path):
    """A rank that stops answering is no loss to replace: the others time out and say which rank
    did not arrive, and the launcher's last line names it as the one it had to stop."""
    args = ["dist.world_size=3", "train.global_batch=12", "dist.timeout_s=2", "dist.max_restarts=1"]
    args += ["fault.hang_rank=1", "fault.hang_step=3", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_script("train.py", *args)
    err = proc.stderr.splitlines()
    assert proc.returncode == 1, err
    # the failures the agent saw first (one survivor's timeout, or both), then the rank it stopped
    assert re.fullmatch(
        r"error: training failed: rank [02] \(exit 1\)(, rank 2 \(exit 1\))?; still running 2 s after, "
        r"so stopped: rank\(s\) \[1\]",
        err[-1],
    ), err
    for rank in (0, 2):
        (said,) = [line for line in err if line.startswith(f"error [rank {rank}]: ")]
        assert "rank(s) [1] did not arrive" in said, said


def test_dist_max_restarts_under_another_launcher_is_refused_in_one_line(tmp_path):
    from e2e import SRUN_TASK as task

    proc = run_script("train.py", "dist.max_restarts=1", f"hydra.run.dir={tmp_path / 'run'}", env=task)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "config error: dist.max_restarts=1 is python train.py's own launcher's (it replaces a lost "
        "worker while the others stay); under srun: requeue the job instead"
    ]


def test_standbys_without_restarts_are_refused_in_one_line(tmp_path):
    proc = run_script("train.py", "dist.standbys=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "config error: dist.standbys=1 keeps workers ready to replace lost ones, and "
        "dist.max_restarts=0 replaces none: set dist.max_restarts too"
    ]


@pytest.mark.slow
def test_a_standby_lost_while_idle_costs_no_restart_and_its_successor_takes_a_lost_ranks_place(tmp_path):
    job = OwnJob(tmp_path / "run", [*STEPS, "dist.standbys=1"], nproc=3, max_restarts=1).start()
    job.wait_for(lambda: job.last_step() >= 2 and job.standbys(), what="step 2 and a standby")
    [idle] = job.standbys()
    job.kill(idle)
    job.wait_for(lambda: job.standbys() not in ([], [idle]), what="the next standby")
    [successor] = job.standbys()
    first = job.ranks()
    t_kill = job.kill(first[2])
    job.wait_for(
        lambda: any(r.get("event") == "restart" and r["time"] > t_kill for r in job.records()),
        what="the restart",
    )
    # the standby is rank 2 now; the survivors kept their processes; another standby waits
    assert job.ranks() == {0: first[0], 1: first[1], 2: successor}
    job.wait_for(lambda: job.standbys() not in ([], [successor]), what="a standby again")
    [last] = job.standbys()
    job.kill(first[0])  # past dist.max_restarts=1 (the idle standby's loss used none)
    assert job.finish(timeout=120) == 1
    _, err = job.output()
    said = f"a standby (pid {idle}) was lost while idle (killed by SIGKILL): another is started; "
    assert said + "no restart is used" in err
    assert f"a standby (pid {successor}) takes its place" in err and "restart 1 of dist.max_restarts=1" in err
    assert "no restart left (dist.max_restarts=1, 1 used)" in err
    assert not any(_alive(pid) for pid in (last, successor, first[1]))  # nothing of the job is left


@pytest.mark.slow
def test_two_ranks_lost_at_once_with_one_standby_are_both_replaced(tmp_path):
    steps = 30
    job = OwnJob(tmp_path / "run", [*chaos.overrides(4, steps, 5), "dist.standbys=1"], 4, max_restarts=2)
    job.start().wait_for(lambda: job.last_step() >= 3 and job.standbys(), what="step 3 and a standby")
    [idle], first = job.standbys(), job.ranks()
    for rank in (1, 2):
        job.kill(first[rank])
    assert job.finish(timeout=120) == 0, job.tail()
    _, err = job.output()
    taken = re.findall(r"rank (\d) was lost \(killed by SIGKILL, pid \d+\): (.+?) takes its place", err)
    assert sorted(rank for rank, _ in taken) == ["1", "2"], err
    # the standby took one place (the first seen lost); the other went to a fork, or to the
    # standby started after it when the second loss was seen in a later poll
    assert f"a standby (pid {idle})" in {who for _, who in taken}
    assert job.seen.keys() >= {first[0], first[3], idle} and len(job.seen) == 6
    records = [r["step"] for r in job.records() if r["type"] == "step"]
    assert sorted(records) == list(range(1, steps + 1))  # every step once


@pytest.mark.slow
def test_a_sigterm_to_every_process_of_the_job_saves_and_stops_leaving_no_standby(tmp_path):
    # as scancel or a service manager signals the whole job: the launcher, its fork server, the
    # workers and the idle standby at once
    job = OwnJob(tmp_path / "run", [*STEPS, "dist.standbys=1"], nproc=2, max_restarts=1).start()
    job.wait_for(lambda: job.last_step() >= 2 and job.standbys(), what="step 2 and a standby")
    [idle] = job.standbys()
    everyone = [job.proc.pid, *_children(job.proc.pid), *job.ranks().values(), idle]
    for pid in everyone:
        os.kill(pid, signal.SIGTERM)
    assert job.finish(timeout=120) == 0, job.tail()
    _, err = job.output()
    assert "SIGTERM: the workers saved a checkpoint at step" in err
    assert "standby" not in err  # not lost, not replaced: dismissed with the job
    assert not any(_alive(pid) for pid in everyone)


@pytest.mark.slow
def test_a_lost_stage_and_shard_of_a_pipeline_and_tensor_parallel_run_is_replaced_byte_identically(tmp_path):
    args = ["dist.pp=2", "dist.tp=2", "checkpoint.memory_every_steps=1", "train.steps=10"]
    clean = run_script("train.py", f"hydra.run.dir={tmp_path / 'clean'}", *args)
    assert clean.returncode == 0, clean.stderr[-2000:]
    kill = ["dist.max_restarts=1", "fault.kill_rank=3", "fault.kill_at_step=4"]
    lost = run_script("train.py", f"hydra.run.dir={tmp_path / 'lost'}", *args, *kill)
    assert lost.returncode == 0, lost.stderr[-2000:]
    assert "rank 3 was lost (killed by SIGKILL" in lost.stderr
    assert chaos.final_files(tmp_path / "lost", 10) == chaos.final_files(tmp_path / "clean", 10)
