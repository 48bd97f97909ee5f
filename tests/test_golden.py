"""Golden losses: every existing layout's per-step losses and final parameters, bit for bit.

The expected values were recorded by ``tests/golden_runs.py`` from known-good commits (the AVX-512
file before the layered-layout refactor) and are committed in ``tests/golden/``, one file per CPU
capability: kernels differ by instruction set (an AVX2 and an AVX-512 machine round differently),
so each machine is compared with the file of its own.
"""

import json

import pytest
import torch
from golden_runs import GOLDEN_DIR, LAYOUTS, golden_file, run_layout

pytestmark = pytest.mark.slow

HERE = torch.backends.cpu.get_cpu_capability()
TABLES = {path: json.loads(path.read_text()) for path in sorted(GOLDEN_DIR.glob("losses-*.json"))}
RECORDED = {table["_cpu_capability"]: path for path, table in TABLES.items()}  # capability -> its file


def test_every_file_holds_every_layout_under_its_own_capability():
    assert RECORDED, f"no golden files in {GOLDEN_DIR}"
    for capability, path in RECORDED.items():
        assert path == golden_file(capability), f"{path} holds the runs of {capability}"
        assert sorted(LAYOUTS) == sorted(k for k in TABLES[path] if not k.startswith("_")), path


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_losses_and_parameters_bitwise_equal_to_golden(name):
    if HERE not in RECORDED:
        pytest.skip(
            f"no golden losses for this machine's CPU capability {HERE} (recorded: "
            f"{', '.join(RECORDED)}; different kernels round differently); record them with "
            f"tests/golden_runs.py --write from a known-good commit"
        )
    got, want = run_layout(name), TABLES[RECORDED[HERE]][name]
    first = next((i for i, (a, b) in enumerate(zip(got["losses"], want["losses"])) if a != b), None)
    assert first is None and len(got["losses"]) == len(want["losses"]), (
        f"{name}: losses differ from golden first at step {None if first is None else first + 1}: "
        f"got {got['losses'][first] if first is not None else got['losses']} want "
        f"{want['losses'][first] if first is not None else want['losses']}"
    )
    assert got["params_sha256"] == want["params_sha256"], f"{name}: final parameters differ from golden"
