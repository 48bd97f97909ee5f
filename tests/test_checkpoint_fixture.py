"""A checkpoint written by the code before the layout refactor (format version 1, committed in
tests/fixtures/) still verifies, loads and continues the run bitwise: steps 11-20 after resuming
from it equal the losses recorded for this machine kind (keyed as tests/golden_runs.py says), or,
where none fits this machine, the pinned commit's resume of it run here (tests/pinned_reference.py)."""

import json
import shutil
from pathlib import Path

from golden_runs import machine_key
from multiproc import run_ranks
from pinned_reference import reference_for
from trainrun import compose_tree, train

FIXTURE = Path(__file__).with_name("fixtures") / "ckpt_v1_ws2_stage1_step10"
EXPECTED = json.loads(FIXTURE.with_name(FIXTURE.name + ".expected.json").read_text())


def test_old_checkpoint_resumes_bitwise(tmp_path, pinned_reference):
    ckpt = tmp_path / "old" / FIXTURE.name
    shutil.copytree(FIXTURE, ckpt)  # loading never writes, but a test must not risk the fixture
    tree = compose_tree(["dist.world_size=2", f"checkpoint.resume={ckpt}"])
    out = run_ranks(train, 2, tree, str(tmp_path / "run"))[0]
    got = {str(k): v for k, v in out["losses"].items()}
    recorded = EXPECTED["losses"].get(machine_key())
    want, source = reference_for(
        got, recorded, lambda: pinned_reference()["fixture"], FIXTURE.name + ".expected.json"
    )
    assert got == want, f"resumed losses differ from {source}"
