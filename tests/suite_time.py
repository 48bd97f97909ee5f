"""The last line of ``make test``: the suite's wall time and the machine kind it ran on, and a
warning when it is over the goal (a warning, not a failure: machines vary; a regression is seen
when it lands, not hidden in a timed unit test).

    .venv/bin/python tests/suite_time.py START_EPOCH   # START_EPOCH: `date +%s` when make test began
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

GOAL_S = 12 * 60  # DEVELOPERS.md: the suite under ~12 minutes on 2 cores


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (or the platform's word for it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def line(seconds: float, key: str, model: str, cores: int) -> str:
    minutes, rest = divmod(round(seconds), 60)
    text = f"make test: {minutes} min {rest:02d} s on {key} ({model}, {cores} cores)"
    if seconds > GOAL_S:
        text += f"\nwarning: make test took over its {GOAL_S // 60}-minute goal on this machine"
    return text


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print(
            "usage: suite_time.py START_EPOCH (the output of `date +%s` when the suite began)",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from golden_runs import machine_key

    print(line(time.time() - int(argv[0]), machine_key(), cpu_model(), os.cpu_count() or 1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
