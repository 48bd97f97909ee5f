"""SLURM without a cluster: hostlist parsing, which processes are ranks, the Hydra arguments an srun
task gets, and the submitit launcher's config. Everything that needs SLURM itself runs against a
real local cluster in tests/test_slurm_cluster.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from e2e import run

from distlib.launch import slurm
from distlib.launch.hydra_config import compose

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node07", "node07"),
        ("node[07-09,12]", "node07"),
        ("gpu[003-004],cpu1", "gpu003"),
        ("rack1-[3-4]-n[01-02]", "rack1-3-n01"),
        ("a[1,5],b[2-3]", "a1"),
    ],
)
def test_first_host_of_a_slurm_hostlist(nodelist, first):
    assert slurm.first_host(nodelist) == first


TASK = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "123457",
    "SLURM_JOB_NODELIST": "cn[10-11]",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "4",
}


def test_slurm_task_environment_maps_to_torch_rendezvous():
    assert slurm.torch_env(TASK) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "cn10",
        "MASTER_PORT": str(20000 + 123457 % 20000),
    }
    assert slurm.torch_env({**TASK, "MASTER_PORT": "29999", "MASTER_ADDR": "head"})["MASTER_PORT"] == "29999"
    # `srun -n 2` inside a 4-task allocation: the step's task count is the world
    assert slurm.torch_env({**TASK, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"})["WORLD_SIZE"] == "2"
    with pytest.raises(slurm.SlurmEnvError, match="SLURM_LOCALID"):
        slurm.torch_env({k: v for k, v in TASK.items() if k != "SLURM_LOCALID"})


def test_only_tasks_of_a_multi_task_step_are_ranks():
    """Observed on the local cluster: the batch shell has SLURM_PROCID=0 and SLURM_NTASKS=4 but no
    SLURM_STEP_ID; srun's tasks have SLURM_STEP_ID and SLURM_STEP_NUM_TASKS."""
    assert slurm.is_rank_task(TASK)
    batch_shell = {k: v for k, v in TASK.items() if not k.startswith("SLURM_STEP")}
    assert not slurm.is_rank_task(batch_shell)
    one_task_step = {**TASK, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}
    assert not slurm.is_rank_task(one_task_step)  # it starts dist.world_size workers itself
    assert not slurm.is_rank_task({})


def test_srun_tasks_share_one_run_directory_and_only_task_0_writes_hydra_files():
    assert slurm.hydra_args({**TASK, "SLURM_PROCID": "0"}, []) == [
        "dist.world_size=4",
        "hydra.run.dir=outputs/slurm/123457",
    ]
    assert slurm.hydra_args(TASK, ["hydra.run.dir=/shared/run", "dist.world_size=4"]) == [
        "hydra.output_subdir=null",
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
    ]


def _hydra(overrides: list[str]):
    return compose(overrides, return_hydra_config=True)


def test_submitit_launcher_is_opt_in_and_runs_one_task_per_job_by_default():
    default = _hydra([])
    assert default.hydra.launcher._target_ == "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    chosen = _hydra(["hydra/launcher=submitit_slurm"])
    launcher = chosen.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    # one launcher setting for every job of a sweep: one task per job, which starts dist.world_size workers
    assert (launcher.nodes, launcher.tasks_per_node) == (1, 1)


HIDE_PLUGIN = """
import importlib.abc, runpy, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("hydra_plugins.hydra_submitit_launcher"):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Hide())
sys.argv = ["train.py", "-m", "hydra/launcher=submitit_slurm", "hydra.sweep.dir=%s"]
runpy.run_path("train.py", run_name="__main__")
"""


def test_slurm_launcher_without_its_plugin_is_one_clear_line(tmp_path):
    """The plugin is hidden from the import system, so this holds where the `slurm` extra is installed too."""
    proc = run([sys.executable, "-c", HIDE_PLUGIN % tmp_path], timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip() == (
        "error: hydra/launcher=submitit_slurm needs the optional plugin, which is not "
        'installed: pip install hydra-submitit-launcher (docs/beyond.md, "SLURM")'
    )
