"""The end-of-run table is bounded: every step of a short run (the capstone's 20), of a longer one
the first, every K-th, the last and the evaluated steps; the full record is metrics.jsonl."""

from distlib.app.observe.results import RunResult, StepLog
from distlib.app.observe.summary import loss_table


def _result(n: int, eval_every: int = 0) -> RunResult:
    return RunResult(
        0,
        [
            StepLog(t, 2.0 / t, 0.5, [1.0], 0.01, 1.0 / t if eval_every and t % eval_every == 0 else None)
            for t in range(1, n + 1)
        ],
    )


def _shown(table: str) -> list[int]:
    return [int(line.split()[0]) for line in table.splitlines()[1:] if line.split()[0].isdigit()]


def test_a_short_run_shows_every_step_and_no_note():
    table = loss_table(_result(20))
    assert _shown(table) == list(range(1, 21)) and "shown" not in table


def test_a_long_run_shows_the_first_every_kth_and_the_last():
    table = loss_table(_result(400))
    assert _shown(table) == [1, *range(20, 401, 20)]
    assert table.splitlines()[-1] == "(21 of 400 steps shown, one in 20; all in the metrics file)"
    odd = loss_table(_result(397))
    assert _shown(odd) == [1, *range(20, 397, 20), 397]


def test_evaluated_steps_are_shown_with_their_validation_loss():
    table = loss_table(_result(400, eval_every=50))
    assert _shown(table) == sorted({1, *range(20, 401, 20), *range(50, 401, 50)})
    row = next(line for line in table.splitlines() if line.split()[0] == "150")
    assert f"{1 / 150:.6f}" in row
