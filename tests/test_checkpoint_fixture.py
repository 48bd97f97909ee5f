"""A checkpoint written by the code before the layout refactor (format version 1, committed in
tests/fixtures/) still verifies, loads and continues the run bitwise: steps 11-20 after resuming
from it equal the losses of the uninterrupted run that wrote it."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from trainrun import compose_tree, train

FIXTURE = Path(__file__).with_name("fixtures") / "ckpt_v1_ws2_stage1_step10"
EXPECTED = json.loads(FIXTURE.with_name(FIXTURE.name + ".expected.json").read_text())


def test_old_checkpoint_resumes_bitwise(tmp_path):
    here = torch.backends.cpu.get_cpu_capability()  # kernels round differently on each
    if here not in EXPECTED["losses"]:
        pytest.skip(
            f"the fixture's losses were recorded on {', '.join(EXPECTED['losses'])} CPUs; this one is {here}"
        )
    ckpt = tmp_path / "old" / FIXTURE.name
    shutil.copytree(FIXTURE, ckpt)  # loading never writes, but a test must not risk the fixture
    tree = compose_tree(["dist.world_size=2", f"checkpoint.resume={ckpt}"])
    out = run_ranks(train, 2, tree, str(tmp_path / "run"))[0]
    assert {str(k): v for k, v in out["losses"].items()} == EXPECTED["losses"][here]
