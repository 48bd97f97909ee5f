"""Any layout resumes at any other, through the real Trainer (distlib/checkpoint/relayout.py).

One Mixtral (so expert parallelism is among the layouts) saves step 3 at each of 12 layouts: one
rank; ep 2 over 2 ranks; and over 4 ranks dp 4 (ZeRO 1), tp 2 x dp 2 (ZeRO 3), pp 2 x dp 2,
cp 2 x dp 2, cp 4 (ZeRO 2), ep 2 (ZeRO 0) and ep 4 over dp 4, pp 2 x ep 2, cp 2 x tp 2, and tp 2
with sequence parallelism x dp 2 (ZeRO 2). The layouts
form a cycle: each resumes from the checkpoint its predecessor saved (the first from the last's),
so every layout is saved once and loaded once, each across a change of several dimensions and
ZeRO stages. Steps 4 and 5 of every resumed run are within 1e-5 of one rank's uninterrupted run
(the 20-step reference tests/test_expert_parallel_train.py shares, trainrun.one_rank_reference), as
every layout's own 20 steps are (that module and the other dimensions' tests): at the exact data
position and state, or its first step would differ by far more (a data position one batch off:
3.5e-2). Two steps after the resume: the first shows the state and position, the second that the
run goes on from them, at the fewest steps (issue 42).
That the bytes move exactly between every pair is tests/test_relayout.py's, for 17 x 17 layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainrun import MIXTRAL_SEED10, one_rank_reference, train_worlds

pytestmark = pytest.mark.slow

REL = 1e-5
# seed 10: no near-tied top-k router choice in 20 steps (tests/test_expert_parallel_train.py)
SAVE, END = 3, 5  # every layout saves step SAVE; a resume trains on to END
BASE = ["model=mixtral_tiny", "seed=10", f"checkpoint.every_steps={SAVE}", "checkpoint.verify_resume=false"]
BASE += ["metrics.progress_every=0"]
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


def test_every_layout_resumes_its_predecessors_checkpoint(tmp_path, tmp_path_factory):
    reference = one_rank_reference(tmp_path_factory, MIXTRAL_SEED10)["losses"][:END]
    sources = [(world, [*layout, f"train.steps={SAVE}"]) for world, layout in CYCLE]  # each saves SAVE
    train_worlds(BASE, _by_world(sources), tmp_path / "saved")
    saved = [_checkpoint(tmp_path / "saved", (i - 1) % len(CYCLE)) for i in range(len(CYCLE))]
    resumes = [
        (w, [*layout, f"train.steps={END}", f"checkpoint.resume={p}"]) for (w, layout), p in zip(CYCLE, saved)
    ]
    resumed = train_worlds(BASE, _by_world(resumes), tmp_path / "resumed")
    assert len(reference) == END and reference[-1] < reference[0]
    for world, runs in resumed.items():
        for layout, run in zip(_by_world(CYCLE)[world], runs):
            assert len(run["losses"]) == END - SAVE, (world, layout)
            worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference[SAVE:]))
            assert worst <= REL, (world, layout, worst)
