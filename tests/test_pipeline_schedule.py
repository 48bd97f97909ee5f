"""Pipeline schedules are plain per-rank action lists; the checker simulates each plan (sends
never block, an action waits for the message it needs) and proves every send is received and
nothing deadlocks, and measures in-flight activations: 1F1B <= P, GPipe == m."""

from __future__ import annotations

import pytest

from distlib.parallel.pipeline import schedule
from distlib.parallel.pipeline.schedule import Action

COMBOS = [(P, m) for P in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


@pytest.mark.parametrize("P,m", COMBOS)
def test_gpipe_and_1f1b(P, m):
    gpipe = schedule.build("gpipe", P, m)
    assert schedule.check(gpipe, P, m) == [m] * P
    ofob = schedule.build("1f1b", P, m)
    peaks = schedule.check(ofob, P, m)
    assert peaks == [min(P - r, m) for r in range(P)]
    assert max(peaks) <= P


@pytest.mark.parametrize("P,m", [(P, m) for P, m in COMBOS if m % P == 0])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved(P, m, v):
    plan = schedule.build("interleaved", P, m, v)
    peaks = schedule.check(plan, P, m, v)
    # Megatron's warm-up bound, in chunk activations (each a 1/v of a rank's layers)
    assert all(peaks[r] <= min(2 * (P - r - 1) + (v - 1) * P + 1, m * v) for r in range(P))
    # every rank goes through the chunks in groups of P micro-batches
    firsts = [a for a in plan[0] if a.kind == "F"][: P * v] if m >= P else []
    assert [a.chunk for a in firsts] == [c for c in range(v) for _ in range(P)][: len(firsts)]


def test_plans_print():
    for name, P, m, v in (("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2)):
        plan = schedule.build(name, P, m, v)
        text = schedule.format_plan(plan)
        print(f"\n{name} pp={P} m={m} v={v} peaks={schedule.check(plan, P, m, v)}\n{text}")
        assert text.count("\n") == P - 1
    assert (
        schedule.format_plan(schedule.build("1f1b", 2, 3))
        == "rank 0: F0 F1 B0 F2 B1 B2\nrank 1: F0 B0 F1 B1 F2 B2"
    )


def test_checker_finds_a_deadlock():
    # rank 1 wants micro-batch 1 first; rank 0 sends it only after micro-batch 0's backward
    plan = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)],
        [Action("F", 1, 0), Action("B", 1, 0), Action("F", 0, 0), Action("B", 0, 0)],
    ]
    with pytest.raises(ValueError, match="deadlocks: rank 0 at B0 waits for .*rank 1 at F1 waits for"):
        schedule.check(plan, 2, 2)
    # a backward before its own forward
    with pytest.raises(ValueError, match="deadlocks"):
        schedule.check([[Action("B", 0, 0), Action("F", 0, 0)]], 1, 1)


def test_checker_finds_missing_and_unmatched():
    plan = schedule.build("1f1b", 2, 2)
    with pytest.raises(ValueError, match="exactly once"):
        schedule.check([plan[0][:-1], plan[1]], 2, 2)
    with pytest.raises(ValueError, match="ranks"):
        schedule.check(plan[:1], 2, 2)


@pytest.mark.parametrize(
    "args,words",
    [
        (("zigzag", 2, 4, 1), "must be one of gpipe, 1f1b, interleaved"),
        (("1f1b", 2, 4, 2), "virtual chunks must be 1"),
        (("interleaved", 2, 4, 1), "at least 2 virtual chunks"),
        (("interleaved", 4, 6, 2), "multiple of the pipeline degree"),
        (("gpipe", 0, 4, 1), "pp >= 1"),
    ],
)
def test_bad_combinations(args, words):
    with pytest.raises(ValueError, match=words) as err:
        schedule.build(*args)
    assert "\n" not in str(err.value)


def test_plans_in_the_docs_are_the_built_ones():
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "parallelism.md").read_text()
    blocks = re.findall(r"<!-- plan: (\w+) (\d+) (\d+) (\d+) -->\n```\n(.*?)\n```", doc, re.S)
    assert len(blocks) == 2
    for name, P, m, v, text in blocks:
        assert schedule.format_plan(schedule.build(name, int(P), int(m), int(v))) == text
