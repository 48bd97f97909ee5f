"""One SLURM task = one rank: ``srun python train.py`` (scripts/train.sbatch) and Hydra's submitit
launcher (conf/hydra/launcher/submitit_slurm.yaml) with several tasks per job.

Inside a job step of several tasks (``srun -n 4 ...``; submitit runs the Hydra job
function in every task the same way) each task is one rank. The batch shell itself
has SLURM_PROCID=0 and SLURM_NTASKS but no SLURM_STEP_ID, and a step of one task
(a submitit job with ``tasks_per_node=1``) starts its ``dist.world_size`` workers
itself, so neither is taken for a rank. torch.distributed's ``env://`` rendezvous wants
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; this module derives
them from SLURM's own variables: the rank is SLURM_PROCID, the master is the
first host of SLURM_JOB_NODELIST, and the port is a function of the job id, so
every task computes the same address without talking to the others. Values
already in the environment (e.g. an explicit MASTER_PORT) win.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

PORT_BASE, PORT_SPAN = 20000, 20000


class SlurmEnvError(RuntimeError):
    """A SLURM task whose environment lacks what a rank needs."""


def is_submitit_task(env: Mapping[str, str]) -> bool:
    return env.get("SUBMITIT_EXECUTOR") == "slurm" and "SLURM_PROCID" in env


def step_tasks(env: Mapping[str, str]) -> int:
    """The number of tasks of the SLURM job step this process is a task of; 0 outside a step."""
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return 0
    return int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)


def is_rank_task(env: Mapping[str, str]) -> bool:
    """True in a task of an srun step of several tasks: this process is rank SLURM_PROCID."""
    return step_tasks(env) > 1


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'node[07-09,12],gpu1' -> 'node07', 'a1-[3-4]-x' -> 'a1-3-x'."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], first)
    if not host or "[" in host or "]" in host:
        raise SlurmEnvError(f"cannot read the first host of SLURM nodelist {nodelist!r}")
    return host


def torch_env(env: Mapping[str, str]) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT for this SLURM task."""
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID") if k not in env]
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist is None and "MASTER_ADDR" not in env:
        missing.append("SLURM_JOB_NODELIST")
    if missing:
        raise SlurmEnvError(
            f"this SLURM task lacks {missing}; run it through srun (the submitit launcher does)"
        )
    port = env.get("MASTER_PORT") or str(PORT_BASE + int(env["SLURM_JOB_ID"]) % PORT_SPAN)
    world = env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": world,
        "LOCAL_RANK": env["SLURM_LOCALID"],
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": port,
    }


def hydra_args(env: Mapping[str, str], argv: list[str]) -> list[str]:
    """Hydra overrides for one task of ``srun -n N python train.py``: without an explicit
    ``hydra.run.dir`` every task would pick its own timestamped directory, so they get
    ``outputs/slurm/<job id>`` (the same for a requeued job, which then resumes there with
    ``checkpoint.resume=latest``); ``dist.world_size`` defaults to the step's task count, as
    under torchrun; tasks other than 0 write none of Hydra's files."""
    extra = []
    if not any(a.startswith("dist.world_size=") for a in argv):
        extra.append(f"dist.world_size={step_tasks(env)}")
    if not any(a.startswith("hydra.run.dir=") for a in argv):
        extra.append(f"hydra.run.dir=outputs/slurm/{env['SLURM_JOB_ID']}")
    if env.get("SLURM_PROCID", "0") != "0":
        extra += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    return extra
