"""Collectives per training step of the capstone configuration (a count, not a timing): after the
update one gather carries the parameter norms, the metrics row (stragglers included) and the
save/stop votes; the guard's verdict stays before the update."""

import sys
from pathlib import Path

import pytest
from multiproc import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import rounds  # noqa: E402

pytestmark = pytest.mark.slow

# gradient reduce-scatter (stage 1), the grad norm's terms gathered, the guard's verdict, the parameter
# all-gather after the sharded update, and the one post-update gather (was three: norms, metrics, decide)
CAPSTONE_COLLECTIVES_PER_STEP = 5


def test_capstone_step_runs_five_collectives_each_waited_on_once(tmp_path):
    tree = rounds.capstone_tree(check=True, steps=3)
    per_rank = run_ranks(rounds.per_step, 4, tree, str(tmp_path))
    for rows in per_rank:
        assert [int(r[1]) for r in rows[1:]] == [CAPSTONE_COLLECTIVES_PER_STEP] * 2, rows
        # the header check rides in the payload's messages, or in the board's barrier (the default
        # on one host): one wait per collective, not two
        assert [int(r[2]) for r in rows[1:]] == [CAPSTONE_COLLECTIVES_PER_STEP] * 2, rows
