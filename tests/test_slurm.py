"""SLURM: the submitit launcher config stays opt-in, and SLURM tasks become ranks (distlib/slurm.py)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from distlib.launch import slurm

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("nodelist, first", [
    ("node07", "node07"),
    ("node[07-09,12]", "node07"),
    ("gpu[003-004],cpu1", "gpu003"),
    ("rack1-[3-4]-n[01-02]", "rack1-3-n01"),
    ("a[1,5],b[2-3]", "a1"),
])
def test_first_host_of_a_slurm_hostlist(nodelist, first):
    assert slurm.first_host(nodelist) == first


def test_slurm_task_environment_maps_to_torch_rendezvous():
    env = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_JOB_ID": "123457", "SLURM_JOB_NODELIST": "cn[10-11]"}
    assert slurm.is_submitit_task(env)
    assert slurm.torch_env(env) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                    "MASTER_ADDR": "cn10", "MASTER_PORT": str(20000 + 123457 % 20000)}
    assert slurm.torch_env({**env, "MASTER_PORT": "29999"})["MASTER_PORT"] == "29999"
    assert not slurm.is_submitit_task({k: v for k, v in env.items() if k != "SUBMITIT_EXECUTOR"})
    with pytest.raises(slurm.SlurmEnvError, match="SLURM_LOCALID"):
        slurm.torch_env({k: v for k, v in env.items() if k != "SLURM_LOCALID"})


def _hydra(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def test_submitit_launcher_is_opt_in():
    default = _hydra([])
    assert default.hydra.launcher._target_ == "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    chosen = _hydra(["hydra/launcher=submitit_slurm"])
    launcher = chosen.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.nodes, launcher.tasks_per_node) == (2, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_slurm_tasks_train_as_two_ranks(tmp_path):
    """What submitit does on a cluster, minus SLURM: two processes with SLURM task variables."""
    port, procs = _free_port(), []
    for rank in range(2):
        env = {**os.environ, "SUBMITIT_EXECUTOR": "slurm", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
               "SLURM_LOCALID": str(rank), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), "dist.world_size=2", "train.steps=4",
             "checkpoint.every_steps=2",
             f"hydra.run.dir={tmp_path}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    assert "RESUME VERIFIED" in outputs[0] and "RESUME VERIFIED" not in outputs[1]
    manifest = json.loads((tmp_path / "checkpoints" / "step_00000002" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["type"] == "step"]) == 4
