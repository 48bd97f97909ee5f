"""Any layout resumes at any other, through the real Trainer (distlib/checkpoint/relayout.py).

One Mixtral (mixtral_tiny at 2 blocks, so expert parallelism is among the layouts) saves step 3 at
each of 12 layouts: one rank; ep 2 over 2 ranks; and over 4 ranks dp 4 (ZeRO 1), tp 2 x dp 2 (ZeRO
3), pp 2 x dp 2, cp 2 x dp 2, cp 4 (ZeRO 2), ep 2 (ZeRO 0) and ep 4 over dp 4, pp 2 x ep 2, cp 2 x
tp 2, and tp 2 with sequence parallelism x dp 2 (ZeRO 2). The layouts form a cycle: each resumes
from the checkpoint its predecessor saved (the first from the last's), so every layout is saved once
and loaded once, each across a change of several dimensions and ZeRO stages. Steps 4 and 5 of every
resumed run are within 1e-5 of one rank's uninterrupted run (the 20-step reference
tests/test_expert_parallel_train.py shares, trainrun.one_rank_reference), as every layout's own 20
steps are (that module and the other dimensions' tests): at the exact data position and state, or
its first step would differ by far more (a data position one batch off: 3.5e-2). Two steps after the
resume: the first shows the state and position, the second that the run goes on from them, at the
fewest steps (issue 42).

And the whole 12 x 12 matrix: every layout loads every layout's checkpoint through the trainer's
loader and then holds exactly the source's state cut for each of its ranks (loading only: 14-21 s for
the 144 pairs, where resuming each and training a step would take minutes). That the bytes move
exactly between 17 x 17 layouts of the checkpoint format itself is tests/test_relayout.py's."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
from trainrun import MIXTRAL_2, QUIET_20, compose_tree, one_rank_reference, train_worlds

from distlib.app.config.run import RunConfig
from distlib.app.trainer import Trainer
from distlib.checkpoint import offline, relayout, sharded
from distlib.launch.torchrun import use_deterministic_kernels
from distlib.parallel.adamw import STATE_KEYS
from distlib.parallel.tensor_parallel import shard_of

pytestmark = pytest.mark.slow

REL = 1e-5
SAVE, END = 3, 5  # every layout saves step SAVE; a resume trains on to END
# the shared reference's model and seed (no near-tied top-k router choice in 20 steps), saving at SAVE
BASE = [o for o in MIXTRAL_2 if o not in QUIET_20]
BASE += [f"checkpoint.every_steps={SAVE}", "checkpoint.verify_resume=false", "metrics.progress_every=0"]
CYCLE = [
    (1, []),
    (2, ["dist.ep=2"]),
    (4, ["zero=stage1"]),
    (4, ["dist.tp=2", "zero=stage3"]),
    (4, ["dist.pp=2"]),
    (4, ["dist.cp=2"]),
    (4, ["dist.cp=4", "zero=stage2"]),
    (4, ["dist.ep=2", "zero=stage0"]),
    (4, ["dist.ep=4"]),
    (4, ["dist.pp=2", "dist.ep=2"]),
    (4, ["dist.cp=2", "dist.tp=2", "dist.cp_impl=ring"]),
    (4, ["dist.tp=2", "dist.sp=true", "zero=stage2"]),
]


def _by_world(runs: list[tuple[int, list[str]]]) -> dict[int, list[list[str]]]:
    out: dict[int, list[list[str]]] = {}
    for world, layout in runs:
        out.setdefault(world, []).append(layout)
    return out


def _checkpoint(root: Path, i: int) -> Path:
    """Where layout ``i`` of CYCLE saved step SAVE (train_worlds: root/ws<N>/<index in its world>)."""
    world = CYCLE[i][0]
    index = [j for j, (w, _) in enumerate(CYCLE) if w == world].index(i)
    return root / f"ws{world}" / str(index) / "checkpoints" / f"step_{SAVE:08d}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> list[Path]:
    """Step SAVE of each layout of CYCLE, in CYCLE's order."""
    root = tmp_path_factory.mktemp("saved")
    sources = [(world, [*layout, f"train.steps={SAVE}"]) for world, layout in CYCLE]  # each saves SAVE
    train_worlds(BASE, _by_world(sources), root)
    return [_checkpoint(root, i) for i in range(len(CYCLE))]


def test_every_layout_resumes_its_predecessors_checkpoint(saved, tmp_path, tmp_path_factory):
    reference = one_rank_reference(tmp_path_factory, MIXTRAL_2)["losses"][:END]
    predecessor = [saved[(i - 1) % len(CYCLE)] for i in range(len(CYCLE))]
    resumes = [
        (w, [*layout, f"train.steps={END}", f"checkpoint.resume={p}"])
        for (w, layout), p in zip(CYCLE, predecessor)
    ]
    resumed = train_worlds(BASE, _by_world(resumes), tmp_path / "resumed")
    assert len(reference) == END and reference[-1] < reference[0]
    for world, runs in resumed.items():
        for layout, run in zip(_by_world(CYCLE)[world], runs):
            assert len(run["losses"]) == END - SAVE, (world, layout)
            worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference[SAVE:]))
            assert worst <= REL, (world, layout, worst)


def _partition(whole: dict[str, torch.Tensor], layout, splits: dict, rank: int) -> torch.Tensor:
    """Partition ``rank`` of ``layout`` of the whole tensors ``whole`` (name -> tensor), each cut by
    its tensor-parallel split: what a rank at that place must hold (padding zero)."""
    flat = torch.zeros(layout.padded_numel)
    for slot in layout.slots:
        piece = shard_of(whole[slot.name], splits.get(slot.name))
        flat[slot.offset : slot.offset + slot.numel] = piece.reshape(-1)
    return flat[slice(*layout.shard_range(rank))]


def _load_each(comm, trees: list[dict], run_dirs: list[str], sources: list[str], wholes: list[dict]) -> list:
    """Each layout (tree) built once, as a run builds it (in its run dir); each source loaded by its
    checkpointer's loader (the resume path). Returns (layout, source, what) of each part that differs
    from the source's whole state cut for this rank (none expected), then the number of comparisons."""
    use_deterministic_kernels()
    wrong, compared = [], 0
    for t, (tree, run_dir) in enumerate(zip(trees, run_dirs)):
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            trainer = Trainer(RunConfig.from_dict(tree), comm, Path(run_dir))
            keeper, optimizer = trainer.checkpointer, trainer.optimizer
            for s, source in enumerate(sources):
                step = keeper.loader.load(Path(source), trainer.model, optimizer, verified=True)
                held = optimizer.state_shard()
                for part in optimizer.partitions():
                    for key in STATE_KEYS:
                        expected = _partition(wholes[s][key], part.layout, keeper.loader.splits, part.rank)
                        compared += 1
                        if not torch.equal(held[part.prefix + key], expected):
                            wrong.append((t, s, part.prefix + key))
                position = keeper.contents.meta(step)["data"]
                if (step, optimizer.step_count, position) != (SAVE, SAVE, wholes[s]["data"]):
                    wrong.append((t, s, (step, optimizer.step_count, position)))
    return [*wrong, compared]


def _whole(path: Path) -> dict:
    """key -> parameter name -> its whole state, and "data" -> the data position, of the checkpoint
    at ``path``."""
    manifest = sharded.verify(path)
    flat = offline.full_state(path, manifest)
    slots = relayout.whole_layout(manifest).slots
    out = {
        k: {s.name: flat[k][s.offset : s.offset + s.numel].view(s.shape) for s in slots} for k in STATE_KEYS
    }
    return {**out, "data": manifest["data"]}


def test_every_layout_loads_every_layouts_checkpoint_exactly(saved, tmp_path):
    """The whole 12 x 12 matrix: each layout loads each layout's checkpoint through the trainer's
    own loader, and then holds, on every rank, the weights and both Adam moments of the source (read
    whole with relayout's reader, exact at 17 x 17 layouts in tests/test_relayout.py) cut for its
    place bit for bit, at the source's step, optimizer step count and data position. The cycle above
    shows that training goes on exactly from a loaded state at every layout; this, that every layout
    loads every other's state."""
    from multiproc import run_ranks

    wholes = [_whole(p) for p in saved]
    for world, group in _by_world([(w, [i]) for i, (w, _) in enumerate(CYCLE)]).items():
        trees = [
            compose_tree([*BASE, *CYCLE[i][1], f"train.steps={SAVE}", f"dist.world_size={world}"])
            for (i,) in group
        ]
        run_dirs = [str(tmp_path / f"ws{world}" / str(i)) for i in range(len(trees))]
        ranks = run_ranks(_load_each, world, trees, run_dirs, [str(p) for p in saved], wholes, timeout_s=600)
        for rank, found in enumerate(ranks):
            assert found[:-1] == [], (world, rank, found[:5])
            assert found[-1] >= len(trees) * len(saved) * len(STATE_KEYS), (world, rank)
