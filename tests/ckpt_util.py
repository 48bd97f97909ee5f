"""Small training runs for the checkpoint tests: a config tree, and a Trainer on real gloo ranks."""

from __future__ import annotations

import copy
from pathlib import Path

from multiproc import run_ranks

from distlib.app.config.run import RunConfig
from distlib.app.faults import step_hooks
from distlib.app.trainer import Trainer
from distlib.checkpoint.sharded import CheckpointError
from distlib.comm.group import Comm

# A global batch of 16 sequences divides over 1, 2 and 4 ranks, so those worlds see the same data.
GLOBAL_BATCH = 16


def tree(world_size: int, steps: int = 6, every: int = 3, **groups: dict) -> dict:
    """A RunConfig tree; ``groups`` update config groups, e.g. checkpoint={"resume": "latest"}."""
    base = {
        "dist": {"world_size": world_size},
        "train": {"steps": steps, "global_batch": GLOBAL_BATCH},
        "checkpoint": {"every_steps": every, "verify_resume": False},
    }
    out = copy.deepcopy(base)
    for group, values in groups.items():
        if isinstance(values, dict):
            out.setdefault(group, {}).update(values)
        else:
            out[group] = values
    return out


def train_rank(comm: Comm, config: dict, run_dir: str) -> dict:
    """One rank of a run; a CheckpointError comes back as data so a test can look at every rank's."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    try:
        cfg = RunConfig.from_dict(config)
        trainer = Trainer(cfg, comm, Path(run_dir), hooks=step_hooks(cfg.fault, comm.rank))
        result = trainer.run()
    except CheckpointError as exc:
        return {"error": str(exc)}
    numel = trainer.optimizer.layout.numel
    return {
        "error": None,
        "start": result.start_step,
        "losses": {s.step: s.loss for s in result.steps},
        "params": trainer.optimizer.flat_params[:numel].numpy().copy(),  # tensors do not survive the queue
        "resume_ok": None if result.resume_check is None else result.resume_check.ok,
    }


def train(config: dict, run_dir: Path) -> list[dict]:
    """Run on ``dist.world_size`` ranks (in this process when it is 1); results by rank."""
    world_size = config["dist"]["world_size"]
    if world_size == 1:
        return [train_rank(Comm.world(), config, str(run_dir))]
    return run_ranks(train_rank, world_size, config, str(run_dir), timeout_s=60)
