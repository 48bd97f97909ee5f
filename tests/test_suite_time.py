"""tests/suite_time.py, the last line of ``make test``: the wall time, the machine kind, and a
warning only past the goal."""

import subprocess
import sys
import time

from e2e import ROOT
from suite_time import GOAL_S, line


def test_the_line_says_the_time_and_the_kind_and_warns_only_past_the_goal():
    assert line(725.4, "AVX2", "AMD EPYC", 2) == "make test: 12 min 05 s on AVX2 (AMD EPYC, 2 cores)\n" + (
        "warning: make test took over its 12-minute goal on this machine"
    )
    assert line(GOAL_S, "AVX512", "Intel Xeon", 2) == "make test: 12 min 00 s on AVX512 (Intel Xeon, 2 cores)"
    assert "warning" not in line(61, "AVX512-amx", "x", 2)


def test_the_script_prints_one_line_from_the_start_time():
    started = int(time.time()) - 90
    out = subprocess.run(
        [sys.executable, "tests/suite_time.py", str(started)], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("make test: 1 min 3") and out.stdout.count("\n") == 1, out.stdout
    bad = subprocess.run([sys.executable, "tests/suite_time.py"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("usage: suite_time.py START_EPOCH")


def test_make_test_ends_with_the_line_and_keeps_the_suites_status():
    recipe = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True).stdout
    suite = recipe[recipe.index("-m pytest") :]
    # the line comes after both pytest runs, and the status make exits with is theirs
    assert "tests/suite_time.py $start; exit $status" in suite, recipe
    assert suite.index("-m serial") < suite.index("tests/suite_time.py"), recipe
