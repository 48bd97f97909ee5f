"""``python train.py dist.nodes=N``: one job over several hosts under the project's own launcher
(distlib/launch/hosts.py). Here the hosts are launchers on this machine meeting at a store on the
loopback (their workers' host keys differ by node rank, so each host's shared-memory groups stay its
own); tests/test_multinode.py runs them in two network namespaces, with a host's workers lost."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from distlib.app.config.run import ConfigError, RunConfig
from distlib.launch import hosts
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


def _host(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _losses(run: Path) -> dict[int, str]:
    return {
        r["step"]: r["loss_hex"]
        for r in map(json.loads, (run / "metrics.jsonl").open())
        if r["type"] == "step"
    }


@pytest.mark.slow
def test_two_hosts_train_one_hosts_losses_and_a_second_claim_to_a_node_rank_is_refused(tmp_path):
    port = _free_port()
    common = ["dist.world_size=4", "dist.nodes=2", f"dist.store=127.0.0.1:{port}", "train.steps=4"]
    common += ["dist.timeout_s=30", f"hydra.run.dir={tmp_path / 'run'}"]
    started = [_host([*common, f"dist.node_rank={k}"], tmp_path) for k in (0, 1, 1)]
    done = [(p.returncode, *p.communicate(timeout=240)) for p in started]
    codes = [p.returncode for p in started]
    assert codes[0] == 0 and sorted(codes[1:]) == [0, 2], done
    refused = done[1 + codes[1:].index(2)][2].strip().splitlines()
    assert refused == ["config error: another host already joined this job as dist.node_rank=1"], done
    assert not any("Traceback" in err for _, _, err in done), done
    one = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "dist.world_size=4",
            "train.steps=4",
            f"hydra.run.dir={tmp_path / 'one'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert one.returncode == 0, one.stderr
    assert _losses(tmp_path / "run") == _losses(tmp_path / "one") and len(_losses(tmp_path / "one")) == 4


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
        "error: host(s) [1] of dist.nodes=2 did not join within dist.timeout_s=4s "
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
    from forkrun import run_script

    task = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_ID": "123",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_STEP_ID": "0",
    }
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
