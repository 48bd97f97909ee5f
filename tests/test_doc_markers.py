"""The machine-kind markers of tests/doc_commands.py (``recorded on``, ``elsewhere within``) read
from small documents written here, and a losses table compared within a tolerance."""

from pathlib import Path

import doc_commands

TABLE = """\
| step | loss |
|---:|---:|
| 10 | 1.390 |
"""

RUN = """\
```bash
make text-demo
```
"""


def _parse(tmp_path: Path, text: str) -> doc_commands.Doc:
    path = tmp_path / "doc.md"
    path.write_text(text, encoding="utf-8")
    return doc_commands.parse(str(path))


def test_a_table_recorded_on_one_kind_carries_its_key_and_tolerance(tmp_path):
    doc = _parse(
        tmp_path,
        "<!-- losses of: outputs/x -->\n<!-- recorded on: AVX512-amx -->\n"
        "<!-- elsewhere within: 0.02 -->\n" + TABLE,
    )
    assert doc.problems == []
    (table,) = doc.tables
    assert (table.line, table.run_dir, table.rows[2]) == (1, "outputs/x", ["10", "1.390"])
    assert (table.recorded_on, table.elsewhere_within) == ("AVX512-amx", 0.02)


def test_a_block_recorded_on_one_kind_is_marked_and_plain_ones_are_not(tmp_path):
    doc = _parse(
        tmp_path,
        RUN + "\n<!-- output of: make text-demo -->\n```\nwrote it\n```\n"
        "\n<!-- output of: make text-demo -->\n<!-- recorded on: AVX2 -->\n```\nRank zero.\n```\n",
    )
    assert doc.problems == []
    (cmd,) = doc.commands
    assert [(s.line, s.lines, s.recorded_on) for s in cmd.outputs] == [
        (7, ["wrote it"], None),
        (13, ["Rank zero."], "AVX2"),
    ]


def test_misplaced_or_malformed_machine_markers_are_named(tmp_path):
    doc = _parse(
        tmp_path,
        "<!-- losses of: outputs/x -->\n<!-- elsewhere within: 0.02 -->\n" + TABLE + "\n"
        "<!-- losses of: outputs/y -->\n<!-- recorded on: avx2 machines -->\n" + TABLE + "\n"
        "<!-- recorded on: AVX2 -->\n" + RUN + "\n"
        "<!-- output of: make text-demo -->\n<!-- recorded on: AVX2 -->\n<!-- elsewhere within: 0.1 -->\n"
        "```\nRank zero.\n```\n\n"
        "<!-- recorded on: AVX2 -->\nsome prose\n\n"
        "<!-- losses of: outputs/z -->\n<!-- recorded on: AVX2 -->\n<!-- elsewhere within: close -->\n"
        + TABLE,
    )
    assert doc.problems == [
        f"{tmp_path}/doc.md:1: 'elsewhere within' without 'recorded on'",
        f"{tmp_path}/doc.md:7: 'avx2 machines' is no machine key (AVX2, AVX512-amx, ...)",
        f"{tmp_path}/doc.md:14: 'recorded on' goes with an 'output of' block",
        f"{tmp_path}/doc.md:21: 'elsewhere within' is for a losses table; a block is compared only "
        "on the kind it was recorded on",
        f"{tmp_path}/doc.md:25: a marker that is not right before a code block: recorded on: AVX2",
        f"{tmp_path}/doc.md:28: 'elsewhere within' needs a number: close",
    ]


def test_a_table_within_a_tolerance_fails_beyond_it():
    rows = [["step", "train loss"], ["---:", "---:"], ["150", "1.390"]]
    near = [{"type": "step", "step": 150, "loss": 1.3865}]
    far = [{"type": "step", "step": 150, "loss": 1.3650}]
    assert doc_commands.table_mismatches(rows, near) == [
        "step 150 train loss: the document says 1.390, the run 1.3865"
    ]
    assert doc_commands.table_mismatches(rows, near, within=0.02) == []
    assert doc_commands.table_mismatches(rows, far, within=0.02) == [
        "step 150 train loss: the document says 1.390, the run 1.365"
    ]
