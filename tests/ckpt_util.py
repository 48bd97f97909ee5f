"""Small training runs for the checkpoint tests: a config tree, and a Trainer on real gloo ranks."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
from multiproc import run_ranks
from safetensors.numpy import load_file

from distlib.app.config.run import RunConfig
from distlib.app.runtime.faults import step_hooks
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


def train_rank(comm: Comm, config: dict, run_dir: str, keep_state: bool = False) -> dict:
    """One rank of a run; a CheckpointError comes back as data so a test can look at every rank's.
    ``keep_state``: also this rank's optimizer partition at the end ("state", ``state_of``)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    try:
        cfg = RunConfig.from_dict(config)
        trainer = Trainer(cfg, comm, Path(run_dir), hooks=step_hooks(cfg.fault, comm.rank))
        result = trainer.run()
    except CheckpointError as exc:
        return {"error": str(exc)}
    return {
        "error": None,
        "start": result.start_step,
        "losses": {s.step: s.loss for s in result.steps},
        "params": trainer.optimizer.full_params().numpy().copy(),  # tensors do not survive the queue
        "resume_ok": None if result.resume_check is None else result.resume_check.ok,
    } | ({"state": state_of(trainer.optimizer)} if keep_state else {})


def train(config: dict, run_dir: Path, keep_state: bool = False) -> list[dict]:
    """Run on ``dist.world_size`` ranks (in this process when it is 1); results by rank."""
    world_size = config["dist"]["world_size"]
    if world_size == 1:
        return [train_rank(Comm.world(), config, str(run_dir), keep_state)]
    return run_ranks(train_rank, world_size, config, str(run_dir), keep_state, timeout_s=60)


# -- checking a checkpoint from its files, independently of the program's own verdicts ----------
OPTIMIZER_STATE = ("master", "exp_avg", "exp_avg_sq")


def assert_files_match_manifest(ckpt: Path) -> dict:
    """Every file the manifest lists is there with its size and the sha256 computed here; returns
    the manifest."""
    manifest = json.loads((Path(ckpt) / "manifest.json").read_text())
    for entry in manifest["files"]:
        data = (Path(ckpt) / entry["path"]).read_bytes()
        assert len(data) == entry["bytes"], f"{ckpt.name}/{entry['path']}: {len(data)} bytes"
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], f"{ckpt.name}/{entry['path']}: sha256"
    return manifest


def saved_state(ckpt: Path, rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s optimizer partition (fp32 master, exp_avg, exp_avg_sq) as its shard file holds
    it, read with safetensors."""
    tensors = load_file(str(Path(ckpt) / f"rank{rank:05d}.safetensors"))
    return {k: tensors[k] for k in OPTIMIZER_STATE}


def state_of(optimizer) -> dict[str, np.ndarray]:
    """A rank's optimizer partition now, as numpy copies (tensors do not survive the queue)."""
    return {k: v.numpy().copy() for k, v in optimizer.state_shard().items()}


def assert_same_state(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    """The same keys, and every array the same bytes (dtype and shape included)."""
    assert sorted(got) == sorted(want), what
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, (what, key)
        assert got[key].tobytes() == want[key].tobytes(), f"{what}: {key} differs"


def assert_same_files(a: Path, b: Path) -> None:
    """Checkpoint directories ``a`` and ``b`` hold the same files, byte for byte (the manifest, which
    lists the others' hashes, last: a difference is named by the file that holds it)."""
    names = sorted(f.name for f in Path(a).iterdir())
    assert names == sorted(f.name for f in Path(b).iterdir()), (a, b)
    for name in sorted(names, key=lambda n: n == "manifest.json"):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), f"{name} differs: {a} vs {b}"


def assert_saved_final_state(ckpt: Path, ranks: list[dict]) -> None:
    """``ckpt`` (a run's last step's) is whole, and each rank's shard holds that rank's optimizer
    state at the end of the run (``ranks[r]["state"]``, ``state_of``)."""
    assert_files_match_manifest(ckpt)
    for rank, run in enumerate(ranks):
        assert_same_state(saved_state(ckpt, rank), run["state"], f"{Path(ckpt).name} rank {rank}")
