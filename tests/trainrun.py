"""Compose the real Hydra config and run the Trainer on forked gloo ranks (no torchrun)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist

from distlib.app.config.run import RunConfig
from distlib.app.runtime.faults import step_hooks
from distlib.app.trainer import Trainer
from distlib.launch.hydra_config import compose_tree  # noqa: F401 - conf/ composed as train.py composes it
from distlib.launch.torchrun import use_deterministic_kernels


def train(comm, tree: dict, run_dir: str) -> dict:
    """One rank of a training run; returns what tests compare (rank 0's view equals every rank's)."""
    use_deterministic_kernels()  # the product's switch: the same ATen flag, without torch._inductor
    Path(run_dir).mkdir(parents=True, exist_ok=True)  # Hydra makes it for train.py
    cfg = RunConfig.from_dict(tree)
    trainer = Trainer(cfg, comm, Path(run_dir), hooks=step_hooks(cfg.fault, comm.rank))  # as train.py
    result = trainer.run()
    return {
        "losses": {s.step: s.loss.hex() for s in result.steps},
        "val": {s.step: s.val_loss for s in result.steps if s.val_loss is not None},
        "params": trainer.optimizer.full_params().numpy().copy(),  # numpy: a tensor would use shared memory
        "resume_ok": None if result.resume_check is None else result.resume_check.ok,
    }


def tree_with(base: dict, **groups) -> dict:
    """A copy of the config tree ``base`` with each named group's values updated."""
    tree = copy.deepcopy(base)
    for group, values in groups.items():
        tree.setdefault(group, {}).update(values)
    return tree


def small_tree(steps: int, every_steps: int, **groups) -> dict:
    """Two ranks, ``steps`` steps, a checkpoint every ``every_steps``, no progress lines, and ``groups``."""
    base = {"train": {"steps": steps}, "dist": {"world_size": 2}, "checkpoint": {"every_steps": every_steps}}
    return tree_with({**base, "metrics": {"progress_every": 0}}, **groups)


def train_each(comm, trees: list[dict], run_dir: str, hooks=None) -> list[dict]:
    """Each tree trained in turn on these ranks (one run_ranks call for many layouts), quietly, in
    ``run_dir``/i, with the trainer's ``hooks`` if given; per run its losses, its step records
    from metrics.jsonl, its tree and every rank's measured memory (the end-of-run table's)."""
    use_deterministic_kernels()
    out = []
    for i, tree in enumerate(trees):
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            trainer = Trainer(RunConfig.from_dict(tree), comm, Path(run_dir) / str(i), hooks=hooks)
            result = trainer.run()
        # rank 0 writes the metrics file, to its end only as its run returns: the others read it
        # after that (read sooner, a half-written last line failed ranks 1 and 3 in one suite run,
        # and rank 0 then waited out the next layout's group)
        dist.barrier()
        log = (Path(run_dir) / str(i) / "metrics.jsonl").read_text().splitlines()
        out.append(
            {
                "losses": [s.loss for s in result.steps],
                "records": [r for r in map(json.loads, log) if r["type"] == "step"],
                "tree": tree,  # (plan_check compares every rank's measured model states with the planner)
                "memory": [row["measured"] for row in result.memory],
            }
        )
    return out


def train_with_margin(comm, tree: dict, run_dir: str, hooks=None) -> dict:
    """An MoE run at world size 1: ``train_each``'s view plus ``margin``, the smallest gap a routing
    choice of the run's training forwards rests on (``routers``: a token's k-th and (k+1)-th choice
    scores; DeepSeek-V3's groups too). A gap within
    rounding can send the token to another expert under another layout's rounding, after which two
    runs part: an equivalence test needs a reference whose margin is well above it."""
    import torch

    from distlib.app.model import moe

    margins = []
    route = moe.MoE.route

    def measured(self, x):
        if torch.is_grad_enabled():  # (the router's own: DeepSeek-V3's counts its groups' gaps too)
            with torch.no_grad():
                margins.append(self.router.margin(self.router.logits(self.gate, x), self.score_bias))
        return route(self, x)

    moe.MoE.route = measured  # (in this forked rank only)
    out = train_each(comm, [tree], run_dir, hooks)[0]
    return {**out, "margin": min(margins)}


def train_worlds(base: list[str], layouts: dict[int, list[list[str]]], root: Path) -> dict[int, list[dict]]:
    """{world size: rank 0's view of each layout (``train_each``'s)}: ``base`` plus each layout's
    overrides at that world size, one run_ranks call per world size, in ``root``/ws<N>."""
    from multiproc import run_ranks

    return {
        world: run_ranks(
            train_each,
            world,
            [compose_tree([*base, *layout, f"dist.world_size={world}"]) for layout in group],
            str(Path(root) / f"ws{world}"),
            timeout_s=600,
        )[0]
        for world, group in layouts.items()
    }


def starving_router(rules: dict, step, first_sample: int, seq_len: int):
    """A forward hook for an MoE router (its gate): the logits masked to -inf where ``rules`` bans an
    expert at step ``step()`` for the sample a row belongs to. ``rules``: step -> {global sample
    (None: every sample): the experts its tokens may not choose}; rows are sample-major, ``seq_len``
    a sample, this rank's first being ``first_sample``."""
    import torch

    def mask(gate, inputs, logits):
        sample = first_sample + torch.arange(logits.shape[0]) // seq_len
        banned = torch.zeros(logits.shape, dtype=torch.bool)
        for who, experts in rules.get(step(), {}).items():
            rows = torch.ones_like(sample, dtype=torch.bool) if who is None else sample == who
            banned[rows.nonzero(), sorted(experts)] = True
        return logits.masked_fill(banned, float("-inf"))

    return mask


# A 20-step run's settings that the equivalence tests share: no checkpoint, no progress lines.
QUIET_20 = ["train.steps=20", "checkpoint.every_steps=0", "checkpoint.verify_resume=false"]
QUIET_20 += ["metrics.progress_every=0"]
# The 20-step Mixtral that several modules compare with at one rank: mixtral_tiny's blocks cut to 2
# (each layout's equivalence is block by block; 4 cost 1.8x the CPU: 8.9 against 4.9 CPU-s for 20
# steps at ep 4 over 4 ranks, issue 42) and seed 21, whose smallest top-k margin in 20 steps is
# 8.2e-6 (seeds 10-21 measured 1.2e-7 to 8.2e-6; a near tie flips with a layout's rounding).
MIXTRAL_2 = ["model=mixtral_tiny", "model.n_layers=2", "seed=21", *QUIET_20]


def one_rank_reference(tmp_path_factory, base: list[str]) -> dict:
    """``train_with_margin`` of ``base`` at world size 1 (its losses, step records and smallest
    top-k margin), trained once per test session whichever module asks first: the pytest-xdist
    workers of one session share it through a file beside their temporary directories (a lock
    makes a second asker wait for the first). Several Mixtral modules compare with the same run."""
    from filelock import FileLock
    from multiproc import run_ranks

    base_dir = tmp_path_factory.getbasetemp()
    root = (base_dir.parent if os.environ.get("PYTEST_XDIST_WORKER") else base_dir) / "shared-references"
    root.mkdir(exist_ok=True)
    tree = compose_tree([*base, "dist.world_size=1"])
    path = root / (hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16] + ".json")
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            result = run_ranks(train_with_margin, 1, tree, str(path.with_suffix(".run")))[0]
            path.write_text(json.dumps(result))
    return json.loads(path.read_text())
