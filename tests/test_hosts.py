"""``python train.py dist.nodes=N``: one job over several hosts under the project's own launcher
(distlib/launch/hosts.py). Here the hosts are launchers on this machine meeting at a store on the
loopback (their workers' host keys differ by node rank, so each host's shared-memory groups stay its
own); tests/test_multinode.py runs them in two network namespaces, with a host's workers lost."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlib.app.config.run import ConfigError, RunConfig
from distlib.launch import heartbeats, hosts
from distlib.launch.hosts import Hosts

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world, count", [(1, 1), (4, 1), (4, 2), (4, 4), (6, 3), (8, 2)])
def test_the_hosts_hold_every_rank_once_in_order(world, count):
    held = [rank for k in range(count) for rank in Hosts(count, k).ranks(world)]
    assert held == list(range(world))
    assert {len(Hosts(count, k).ranks(world)) for k in range(count)} == {world // count}


def test_a_follower_is_a_nonzero_node_rank_on_the_command_line():
    assert hosts.follower(["train.steps=3"]) is None
    assert hosts.follower(["dist.node_rank=0", "dist.nodes=2"]) is None
    assert hosts.follower(["dist.nodes=2", "dist.node_rank=1", "dist.store=a:5"]) == (1, "a:5", 60.0)
    assert hosts.follower(["++dist.node_rank=2", "dist.timeout_s=7.5"]) == (2, None, 7.5)
    with pytest.raises(hosts.HostError, match=r"^config error: dist.node_rank=one"):
        hosts.follower(["dist.node_rank=one"])


def test_a_command_line_is_the_same_but_for_the_node_rank_in_order():
    node0 = ["dist.nodes=2", "dist.store=a:5", "train.steps=3"]
    assert (
        hosts.same_command(["dist.nodes=2", "dist.store=a:5", "train.steps=3", "dist.node_rank=1"], node0)
        is None
    )
    assert hosts.same_command(["dist.node_rank=1", *node0], [*node0, "dist.node_rank=0"]) is None
    differs = hosts.same_command(
        ["dist.nodes=2", "dist.store=a:5", "train.steps=4", "dist.node_rank=1"], node0
    )
    assert "train.steps=4" in differs and "train.steps=3" in differs
    assert hosts.same_command(["train.steps=3", "dist.nodes=2", "dist.store=a:5"], node0) is not None


@pytest.mark.parametrize(
    "dist, says",
    [
        ({"nodes": 2}, "dist.store=None is not HOST:PORT"),
        ({"nodes": 2, "store": "node0"}, "dist.store=node0 is not HOST:PORT"),
        ({"nodes": 2, "store": "node0:0"}, "dist.store=node0:0 is not HOST:PORT"),
        ({"nodes": 2, "store": "node0:70000"}, "dist.store=node0:70000 is not HOST:PORT"),
        ({"nodes": 3, "store": "node0:5"}, "dist.world_size=4 does not split evenly over dist.nodes=3"),
        ({"nodes": 2, "node_rank": 2, "store": "node0:5"}, "dist.node_rank=2 is no host of dist.nodes=2"),
        ({"store": "node0:5"}, "dist.store=node0:5 is where the hosts of a job with dist.nodes > 1 meet"),
    ],
)
def test_a_wrong_hosts_setting_is_one_line_naming_it(dist, says):
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_dict({"dist": {"world_size": 4, **dist}})
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_hosts_that_agree_are_accepted():
    d = RunConfig.from_dict({"dist": {"world_size": 4, "nodes": 2, "store": "node0:29500"}}).dist
    assert (d.nodes, d.node_rank, d.store) == (2, 0, "node0:29500")


def _host(args: list[str], cwd: Path, shm: Path | None = None, session: bool = False) -> subprocess.Popen:
    """``python train.py args`` from ``cwd``; ``shm``: the host's own memory for its snapshots
    (separate hosts do not share /dev/shm); ``session``: in a process group of its own (to be lost
    whole)."""
    env = {**os.environ, "DISTLIB_SHM_DIR": str(shm)} if shm else None
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        start_new_session=session,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _two_hosts(tmp_path: Path, args: list[str], whole: int | None = None) -> tuple[subprocess.Popen, ...]:
    """Node 0 and host 1 of a job with ``args``, each with its own memory for its snapshots
    (tmp_path/shm<k>); ``whole``: the host started in a process group of its own (to be lost whole)."""
    started = []
    for k in (0, 1):
        memory = tmp_path / f"shm{k}"
        memory.mkdir()
        started.append(_host([*args, f"dist.node_rank={k}"], tmp_path, memory, session=whole == k))
    return tuple(started)


def _until_step(tmp_path: Path, step: int, node0: subprocess.Popen) -> None:
    """Wait (at most 120 s, or until node 0 ends) until the run recorded ``step`` steps."""
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + 120
    while time.monotonic() < deadline and node0.poll() is None:
        lines = metrics.read_text().splitlines()[:-1] if metrics.exists() else []
        if sum('"type": "step"' in line for line in lines) >= step:
            return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """A function giving the run directory of ``python train.py dist.world_size=4`` with these
    overrides on one host, each run once for the module: what the several-host jobs must equal."""
    runs: dict[tuple[str, ...], Path] = {}

    def run(*overrides: str) -> Path:
        if overrides not in runs:
            where = tmp_path_factory.mktemp("one_host") / "run"
            args = [
                sys.executable,
                str(ROOT / "train.py"),
                "dist.world_size=4",
                *overrides,
                f"hydra.run.dir={where}",
            ]
            done = subprocess.run(args, cwd=where.parent, capture_output=True, text=True, timeout=240)
            assert done.returncode == 0, done.stderr
            runs[overrides] = where
        return runs[overrides]

    return run


SNAPSHOTTED = ("train.steps=20", "checkpoint.memory_every_steps=1")


def _losses(run: Path) -> dict[int, str]:
    return {
        r["step"]: r["loss_hex"]
        for r in map(json.loads, (run / "metrics.jsonl").open())
        if r["type"] == "step"
    }


@pytest.mark.slow
def test_two_hosts_train_one_hosts_losses_and_a_second_claim_to_a_node_rank_is_refused(tmp_path, one_host):
    port = _free_port()
    common = ["dist.world_size=4", "dist.nodes=2", f"dist.store=127.0.0.1:{port}", "train.steps=4"]
    common += ["dist.timeout_s=30", f"hydra.run.dir={tmp_path / 'run'}"]
    started = [_host([*common, f"dist.node_rank={k}"], tmp_path) for k in (0, 1, 1)]
    done = [(p.returncode, *p.communicate(timeout=240)) for p in started]
    codes = [p.returncode for p in started]
    assert codes[0] == 0 and sorted(codes[1:]) == [0, 2], done
    joined = done[1 + codes[1:].index(0)][1].splitlines()
    here = (
        f"node 1 joined the job at 127.0.0.1:{port}: ranks [2, 3] run here; run directory {tmp_path / 'run'}"
    )
    assert joined[0] == here, joined
    refused = done[1 + codes[1:].index(2)][2].strip().splitlines()
    assert refused == ["config error: another host already joined this job as dist.node_rank=1"], done
    assert not any("Traceback" in err for _, _, err in done), done
    one = one_host("train.steps=4")
    assert _losses(tmp_path / "run") == _losses(one) and len(_losses(one)) == 4


def test_a_host_whose_command_differs_is_refused_and_node0_names_it_missing(tmp_path):
    port = _free_port()
    common = ["dist.world_size=2", "dist.nodes=2", f"dist.store=127.0.0.1:{port}", "dist.timeout_s=4"]
    common.append(f"hydra.run.dir={tmp_path / 'run'}")
    node0 = _host([*common, "train.steps=3", "dist.node_rank=0"], tmp_path)
    node1 = _host([*common, "train.steps=4", "dist.node_rank=1"], tmp_path)
    out1, err1 = node1.communicate(timeout=120)
    out0, err0 = node0.communicate(timeout=120)
    assert node1.returncode == 2 and err1.strip().splitlines() == [
        "config error: this host's command line differs from node 0's (every host runs the same one but "
        f"for dist.node_rank): here {' '.join(common)} train.steps=4; "
        f"on node 0 {' '.join(common)} train.steps=3"
    ], err1
    assert node0.returncode == 1, err0
    assert err0.strip().splitlines()[-1] == (
        "error: node(s) [1] of dist.nodes=2 did not join within dist.timeout_s=4s "
        "(run the same command there with dist.node_rank set)"
    ), err0


def test_a_host_whose_node0_never_comes_names_the_store_in_one_line(tmp_path):
    port = _free_port()
    args = ["dist.world_size=2", "dist.nodes=2", f"dist.store=127.0.0.1:{port}", "dist.timeout_s=2"]
    proc = _host([*args, "dist.node_rank=1"], tmp_path)
    out, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, err
    assert lines[0].startswith(
        f"error: node 0's store at 127.0.0.1:{port} (dist.store) did not answer within "
    )
    assert not list(tmp_path.iterdir())  # nothing written


def test_dist_nodes_under_srun_is_refused_in_one_line(tmp_path):
    from e2e import SRUN_TASK as task
    from forkrun import run_script

    args = [
        "dist.world_size=2",
        "dist.nodes=2",
        "dist.store=node0:29500",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = run_script("train.py", *args, env=task)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "config error: dist.nodes=2 is python train.py's own launcher's; under srun: pass --nodes instead"
    ]


def _store():
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5)
    )


def test_node0_takes_a_silent_host_for_lost_once_and_fences_it_and_never_a_finished_one(monkeypatch):
    monkeypatch.setattr(heartbeats, "BEAT_S", 0.0)
    monkeypatch.setattr(heartbeats, "LOST_S", 0.3)
    store = _store()
    node0, node1, node2 = (heartbeats.Watch(store, Hosts(3, k), k == 0) for k in range(3))
    assert node1.beat() == [] and node2.beat() == [] and node0.beat() == []
    store.set(heartbeats.done_key(2), "1")  # host 2's workers all finished: it stops beating, and is not lost
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # host 1 beating: never lost
        assert node1.beat() == [] and node0.beat() == []
        time.sleep(0.02)
    time.sleep(0.4)  # now both are silent
    assert node0.beat() == [1]
    assert node0.beat() == []  # (once)
    with pytest.raises(heartbeats.Fenced, match=r"^error: the job took node 1 for lost"):
        node1.beat()
    assert heartbeats.Watch(store, Hosts(1, 0), True).beat() == []  # one host: no heartbeat at all


def test_a_worker_of_a_host_taken_for_lost_enters_no_later_generation(monkeypatch):
    from distlib.launch import generations

    store = _store()
    monkeypatch.setattr(generations, "_AT", [])  # (a client of another test's store is no longer wanted)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv(generations.ENV, "0")
    store.add(generations.KEY, 1)  # a later generation has begun
    monkeypatch.setenv("GROUP_RANK", "1")
    assert generations.next_generation(5.0) == 1
    store.set(heartbeats.lost_key(1), "1")
    store.get(heartbeats.lost_key(1))  # (a set is not answered: this makes sure the store has it)
    assert generations.next_generation(5.0) is None
    monkeypatch.setenv("GROUP_RANK", "0")  # node 0's (and the ranks it started for host 1) enter it
    assert generations.next_generation(5.0) == 1


@pytest.mark.slow
def test_a_host_fenced_as_lost_stops_its_workers_and_node0_runs_its_ranks_to_one_hosts_losses(
    tmp_path, one_host
):
    """A host node 0 takes for lost while it still runs (cut off, say) stops its own workers once
    it reads the mark; node 0, hearing from it no more, starts its ranks itself, and the job ends
    with one host's losses, each step recorded once."""
    import datetime

    import torch.distributed as dist

    port = _free_port()
    common = ["dist.world_size=4", "dist.nodes=2", f"dist.store=127.0.0.1:{port}", "train.steps=20"]
    common += ["dist.max_restarts=2", "checkpoint.memory_every_steps=1", "fault.slow_rank=0"]
    common += ["fault.slow_seconds=0.2", f"hydra.run.dir={tmp_path / 'run'}"]
    node0, node1 = _two_hosts(tmp_path, common)
    _until_step(tmp_path, 4, node0)
    metrics = tmp_path / "run" / "metrics.jsonl"
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    store.set(heartbeats.lost_key(1), "1")
    out1, err1 = node1.communicate(timeout=120)
    out0, err0 = node0.communicate(timeout=240)
    assert node1.returncode == 1 and err1.strip().splitlines()[-1] == (
        "error: the job took node 1 for lost (no heartbeat for 2 s) and runs its ranks elsewhere: "
        "this node's workers are stopped"
    ), err1
    assert node0.returncode == 0, err0
    assert "node 1 was lost (no heartbeat from its agent for 2 s): its ranks start here (rank 2: " in err0
    assert re.search(
        r"^resume: from the memory snapshot of step ([5-9]|1\d) in ", out0 + err0, re.MULTILINE
    ), err0
    one = one_host(*SNAPSHOTTED)
    recorded = [r["step"] for r in map(json.loads, metrics.open()) if r["type"] == "step"]
    assert recorded == list(range(1, 21)), recorded
    assert _losses(tmp_path / "run") == _losses(one)


@pytest.mark.slow
def test_node0_lost_with_its_store_the_store_moves_and_the_job_ends_with_one_hosts_losses(tmp_path, one_host):
    """Node 0 (its launcher, agent, store and workers) SIGKILLed mid-run: host 1 serves the job's
    store on the address it offered, starts node 0's ranks (the first in its idle standby, which
    it replaces by one that joins the store where it is now), its own workers stay, and the job
    ends with one host's losses, each step recorded once."""

    port = _free_port()
    common = ["dist.world_size=4", "dist.nodes=2", f"dist.store=127.0.0.1:{port}", "train.steps=20"]
    common += [
        "dist.max_restarts=2",
        "dist.standbys=1",
        "checkpoint.memory_every_steps=1",
        "fault.slow_rank=3",
    ]
    common += ["fault.slow_seconds=0.2", f"hydra.run.dir={tmp_path / 'run'}"]
    node0, node1 = _two_hosts(tmp_path, common, whole=0)
    _until_step(tmp_path, 4, node0)
    metrics = tmp_path / "run" / "metrics.jsonl"
    os.killpg(node0.pid, signal.SIGKILL)  # its launcher, fork server and workers: the whole host
    node0.communicate(timeout=60)
    moved = time.monotonic() + 120
    while time.monotonic() < moved and node1.poll() is None and len(_ranks_under(node1.pid)) < 4:
        time.sleep(0.05)
    time.sleep(1.5)  # (a standby started for the old store would have failed by now)
    standbys = [pid for pid, name in _named_under(node1.pid).items() if name == "distlib-standby"]
    locked = json.loads((tmp_path / "run" / ".distlib.lock").read_text())
    out1, err1 = node1.communicate(timeout=240)
    assert node1.returncode == 0, err1
    assert re.search(
        r"^node 0 \(the job's store at 127.0.0.1:\d+ is gone\): node 1 serves it now, at ", err1, re.M
    )
    taken = r"node 0 was lost \(its store is gone\): its ranks start here \(rank 0: a standby \(pid \d+\), "
    assert re.search(taken + r"rank 1: a new worker\)", err1), err1
    # the standby taken is replaced by one that joined the store where it is now
    assert len(standbys) == 1 and "could not join" not in err1, (standbys, err1)
    assert locked["pid"] == node1.pid, locked  # the run directory's lock passed to node 1 with the store
    assert re.search(r"^resume: from the memory snapshot of step ([4-9]|1\d) in ", out1, re.MULTILINE), out1
    one = one_host(*SNAPSHOTTED)
    recorded = [r["step"] for r in map(json.loads, metrics.open()) if r["type"] == "step"]
    assert recorded == list(range(1, 21)), recorded
    assert _losses(tmp_path / "run") == _losses(one)


@pytest.mark.slow
def test_a_host_lost_past_the_restarts_ends_the_job_naming_it(tmp_path):

    port = _free_port()
    common = ["dist.world_size=4", "dist.nodes=2", f"dist.store=127.0.0.1:{port}", "train.steps=200"]
    common += ["dist.max_restarts=1", f"hydra.run.dir={tmp_path / 'run'}"]
    node0, node1 = _two_hosts(tmp_path, common, whole=1)
    _until_step(tmp_path, 1, node0)
    os.killpg(node1.pid, signal.SIGKILL)  # the whole host: its launcher, agent and workers
    node1.communicate(timeout=60)
    out0, err0 = node0.communicate(timeout=120)
    assert node0.returncode == 1, err0
    assert err0.strip().splitlines()[-1] == (
        "error: training failed: node 1 (no heartbeat from its agent for 2 s); no restart left for its "
        "ranks (dist.max_restarts=1, 0 used)"
    ), err0
    for rank in (0, 1):  # each survivor said why it stopped, in its own line
        assert sum(line.startswith(f"error [rank {rank}]: ") for line in err0.splitlines()) == 1, err0
    assert "Traceback" not in err0


@pytest.mark.slow
def test_a_stop_on_node0_stops_every_host_and_the_printed_line_continues_the_job_on_both(tmp_path, one_host):
    """SIGTERM to node 0's launcher: every rank of both hosts saves and stops at one step, both
    exit 0, and node 0's last line says how to continue; that line, typed on both hosts (host 1
    with its node rank), finishes the job with one host's losses, each step recorded once."""

    port = _free_port()
    common = ["dist.world_size=4", "dist.nodes=2", f"dist.store=127.0.0.1:{port}", "train.steps=40"]
    common += ["fault.slow_rank=0", "fault.slow_seconds=0.05", f"hydra.run.dir={tmp_path / 'run'}"]
    node0, node1 = _two_hosts(tmp_path, common)
    _until_step(tmp_path, 5, node0)
    metrics = tmp_path / "run" / "metrics.jsonl"
    node0.send_signal(signal.SIGTERM)
    (_, err0), (_, err1) = node0.communicate(timeout=120), node1.communicate(timeout=120)
    assert node0.returncode == 0 and node1.returncode == 0, err0 + err1
    said = re.fullmatch(
        r"SIGTERM: the workers saved a checkpoint at step (\d+) and stopped; continue with (.*) on every "
        r"host, each with its dist.node_rank",
        err0.strip().splitlines()[-1],
    )
    assert said and 5 <= int(said.group(1)) < 40, err0
    line = said.group(2).split()
    assert line == [
        "checkpoint.resume=latest",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"dist.store=127.0.0.1:{port}",
    ]
    again = [_host(line, tmp_path), _host([*line, "dist.node_rank=1"], tmp_path)]
    done = [(p.returncode, *p.communicate(timeout=240)) for p in again]
    assert [p.returncode for p in again] == [0, 0], done
    recorded = [r["step"] for r in map(json.loads, metrics.open()) if r["type"] == "step"]
    assert recorded == list(range(1, 41)), recorded
    assert _losses(tmp_path / "run") == _losses(one_host("train.steps=40"))


def _named_under(launcher: int) -> dict[int, str]:
    """{pid: name} of the processes descending from process ``launcher``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = {}, list(children.get(launcher, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            found[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
    return found


def _ranks_under(launcher: int) -> dict[int, int]:
    """{rank: pid} of the workers (named distlib-rank<N>) descending from process ``launcher``."""
    prefix = "distlib-rank"
    named = _named_under(launcher).items()
    return {int(name.removeprefix(prefix)): pid for pid, name in named if name.startswith(prefix)}


@pytest.mark.slow
def test_a_worker_lost_on_each_host_at_once_is_replaced_by_its_host_and_the_others_stay(tmp_path, one_host):
    """Both hosts lose a worker at the same moment: each agent begins a generation for its own, the
    ranks of the first move on to the second, and the job ends with one host's losses, each step
    recorded once; the two ranks not killed are the same processes throughout."""
    port = _free_port()
    common = ["dist.world_size=4", "dist.nodes=2", f"dist.store=127.0.0.1:{port}", *SNAPSHOTTED]
    common += ["dist.max_restarts=2", "fault.slow_rank=0", "fault.slow_seconds=0.2"]
    common.append(f"hydra.run.dir={tmp_path / 'run'}")
    node0, node1 = _two_hosts(tmp_path, common)
    _until_step(tmp_path, 4, node0)
    before = {**_ranks_under(node0.pid), **_ranks_under(node1.pid)}
    assert sorted(before) == [0, 1, 2, 3], before
    for rank in (1, 3):
        os.kill(before[rank], signal.SIGKILL)
    _until_step(tmp_path, 8, node0)
    after = {**_ranks_under(node0.pid), **_ranks_under(node1.pid)}
    (_, err0), (_, err1) = node0.communicate(timeout=240), node1.communicate(timeout=240)
    assert node0.returncode == 0 and node1.returncode == 0, err0 + err1
    assert "rank 1 was lost (killed by SIGKILL" in err0 and "rank 3 was lost (killed by SIGKILL" in err1
    assert {r: after[r] for r in (0, 2)} == {r: before[r] for r in (0, 2)}, (before, after)
    assert all(after[r] != before[r] for r in (1, 3)), (before, after)
    metrics = tmp_path / "run" / "metrics.jsonl"
    recorded = [r["step"] for r in map(json.loads, metrics.open()) if r["type"] == "step"]
    assert recorded == list(range(1, 21)), recorded
    assert _losses(tmp_path / "run") == _losses(one_host(*SNAPSHOTTED))


def test_a_joining_hosts_node_rank_is_checked_against_node0s_configuration():
    from distlib.launch.hydra_config import compose_tree

    store = _store()
    argv = ["dist.nodes=2", "dist.store=a:5"]
    hosts.publish(store, compose_tree(argv), "/run", tuple(argv))
    with pytest.raises(hosts.HostError) as caught:
        hosts.job(store, [*argv, "dist.node_rank=2"], 2, 5.0)
    assert str(caught.value) == "config error: dist.node_rank=2 is no host of dist.nodes=2 (0 to 1)"
    assert caught.value.code == 2
    assert hosts.job(store, [*argv, "dist.node_rank=1"], 1, 5.0)[1] == "/run"
