"""Golden losses: every existing layout's per-step losses and final parameters, bit for bit.

The expected values were recorded by ``tests/golden_runs.py`` before the layered-layout refactor
and are committed in ``tests/golden/losses.json``. CPU kernels differ by instruction set (an AVX2
and an AVX-512 machine round differently), so the file names the capability it was recorded on.
"""

import json

import pytest
import torch
from golden_runs import GOLDEN, LAYOUTS, run_layout

pytestmark = pytest.mark.slow

EXPECTED = json.loads(GOLDEN.read_text())


def test_every_layout_is_in_the_golden_file():
    assert sorted(LAYOUTS) == sorted(k for k in EXPECTED if not k.startswith("_"))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_losses_and_parameters_bitwise_equal_to_golden(name):
    recorded_on, here = EXPECTED["_cpu_capability"], torch.backends.cpu.get_cpu_capability()
    if recorded_on != here:
        pytest.skip(
            f"golden losses were recorded with CPU capability {recorded_on}; this machine has {here} "
            f"(different kernels round differently); regenerate with tests/golden_runs.py --write on "
            f"a {here} machine from a known-good commit"
        )
    got, want = run_layout(name), EXPECTED[name]
    first = next((i for i, (a, b) in enumerate(zip(got["losses"], want["losses"])) if a != b), None)
    assert first is None and len(got["losses"]) == len(want["losses"]), (
        f"{name}: losses differ from golden first at step {None if first is None else first + 1}: "
        f"got {got['losses'][first] if first is not None else got['losses']} want "
        f"{want['losses'][first] if first is not None else want['losses']}"
    )
    assert got["params_sha256"] == want["params_sha256"], f"{name}: final parameters differ from golden"
