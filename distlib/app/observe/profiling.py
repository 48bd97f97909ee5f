"""``train.profile_steps=[a, b]``: a torch.profiler Chrome trace of steps a..b, one file per rank.

The profiler starts when step a begins and stops when step b ends; each rank then writes
``<run dir>/traces/rank<R>.json`` (open it in chrome://tracing or https://ui.perfetto.dev). Every
profiled step is a range named ``step <n>``, and every hand-written collective a range named
``collective:<kind> algo=<algorithm> bytes=<bytes>`` (``distlib.comm.header.collective``), which
is what ``scripts/report.py`` splits each rank's time with. A window cut short (a rollback to
before it, an early stop, an error) is written as far as it got when the run ends.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

TRACE_DIR = "traces"


def trace_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / TRACE_DIR / f"rank{rank}.json"


class StepProfiler:
    def __init__(self, window: tuple[int, int] | None, run_dir: Path, rank: int):
        self.window, self.path = window, trace_path(run_dir, rank)
        self._profile: profile | None = None
        self._range: contextlib.AbstractContextManager | None = None
        self.written: Path | None = None

    def begin(self, step: int) -> None:
        """Called as ``step`` starts."""
        if self.window is None or self.written is not None or not self.window[0] <= step <= self.window[1]:
            return
        self._end_range()  # a step that rolled back never reached end()
        if self._profile is None:
            self._profile = profile(activities=[ProfilerActivity.CPU])
            self._profile.__enter__()
        self._range = record_function(f"step {step}")
        self._range.__enter__()

    def end(self, step: int) -> None:
        """Called as ``step`` ends (after its metrics and any save)."""
        self._end_range()
        if self._profile is not None and step >= self.window[1]:
            self.close()

    def _end_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def close(self) -> None:
        """Stop the profiler, if it runs, and write the trace."""
        if self._profile is None:
            return
        self._end_range()
        self._profile.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self.path))
        self._profile, self.written = None, self.path


def enabled() -> bool:
    """Whether a profiler is collecting now (cheap: one C call, ~0.1 us)."""
    return torch.autograd._profiler_enabled()
