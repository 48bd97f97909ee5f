"""One SLURM task = one rank, for Hydra's submitit launcher (conf/hydra/launcher/submitit_slurm.yaml).

submitit runs the Hydra job function in every task of a SLURM job (``srun``,
``tasks_per_node`` tasks on each of ``nodes`` nodes) and marks them with
``SUBMITIT_EXECUTOR=slurm``. torch.distributed's ``env://`` rendezvous wants
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; this module derives
them from SLURM's own variables: the rank is SLURM_PROCID, the master is the
first host of SLURM_JOB_NODELIST, and the port is a function of the job id, so
every task computes the same address without talking to the others. Values
already in the environment (e.g. an explicit MASTER_PORT) win.
"""
from __future__ import annotations

import re
from typing import Mapping

PORT_BASE, PORT_SPAN = 20000, 20000


class SlurmEnvError(RuntimeError):
    """A SLURM task whose environment lacks what a rank needs."""


def is_submitit_task(env: Mapping[str, str]) -> bool:
    return env.get("SUBMITIT_EXECUTOR") == "slurm" and "SLURM_PROCID" in env


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
        raise SlurmEnvError(f"this SLURM task lacks {missing}; run it through srun (the submitit launcher does)")
    port = env.get("MASTER_PORT") or str(PORT_BASE + int(env["SLURM_JOB_ID"]) % PORT_SPAN)
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env["SLURM_LOCALID"],
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodelist), "MASTER_PORT": port}
