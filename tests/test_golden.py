"""Golden losses: every existing layout's per-step losses and final parameters, bit for bit.

The reference is this machine kind's committed file (``tests/golden/losses-<key>.json``, the key
as ``golden_runs.machine_key()`` says) where it holds this machine's bits, and otherwise the pinned
known-good commit run on this machine (tests/pinned_reference.py, cached under .pytest_cache): a
machine without a file still compares bitwise, and a file recorded on a machine that rounds
differently under the same key fails nothing. A layout re-pinned to the commit that changed its
arithmetic on purpose (``pinned_reference.REPINNED``) is compared with that commit's run here
where its file has no entry (null) for it. It skips only where the pinned commit cannot be run
(no git history holding it), and says so.

A new machine kind's file: ``.venv/bin/python tests/golden_runs.py --record`` (from the pinned
commit, ~45 s; it adds the fixture's entry too), then commit tests/golden/losses-<key>.json and
tests/fixtures/*.expected.json with the machine named in the message.
"""

import json

import pytest
from golden_runs import GOLDEN_DIR, LAYOUTS, golden_file, machine_key, run_layout
from pinned_reference import commit_of, reference_for

pytestmark = pytest.mark.slow

KEY = machine_key()
TABLES = {path: json.loads(path.read_text()) for path in sorted(GOLDEN_DIR.glob("losses-*.json"))}


def test_every_file_holds_every_layout_under_its_own_key():
    assert TABLES, f"no golden files in {GOLDEN_DIR}"
    for path, table in TABLES.items():
        key = path.name.removeprefix("losses-").removesuffix(".json")
        assert path == golden_file(key) and key.split("-")[0] == table["_cpu_capability"], path
        assert sorted(LAYOUTS) == sorted(k for k in table if not k.startswith("_")), path


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_losses_and_parameters_bitwise_equal_to_golden(name, pinned_reference):
    got = run_layout(name)
    recorded = TABLES.get(golden_file(KEY), {}).get(name)
    recorded = recorded and {k: recorded[k] for k in ("losses", "params_sha256")}
    want, source = reference_for(
        got, recorded, lambda: pinned_reference()["layouts"][name], golden_file(KEY).name, commit_of(name)
    )
    first = next((i for i, (a, b) in enumerate(zip(got["losses"], want["losses"])) if a != b), None)
    assert first is None and len(got["losses"]) == len(want["losses"]), (
        f"{name}: losses differ from {source} first at step {None if first is None else first + 1}: "
        f"got {got['losses'][first] if first is not None else got['losses']} want "
        f"{want['losses'][first] if first is not None else want['losses']}"
    )
    assert got["params_sha256"] == want["params_sha256"], f"{name}: final parameters differ from {source}"
