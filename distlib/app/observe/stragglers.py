"""Which rank is slowest, by how much, and when it is a straggler (``guard.straggler_*``).

In a synchronous step every rank waits for the slowest one inside the collectives, so per-rank
step times come out nearly equal; what differs is the time a rank spends *outside* collectives,
its busy time (step time minus the seconds its collectives took, waiting included). The slowest
rank is the busiest one; its lag is how far it is above the median busy time. A rank that is the
slowest and busier than ``straggler_factor`` x the median for ``straggler_window`` steps in a row
is a straggler: one ``straggler`` event names it (again only after its streak broke).

Every rank holds the same gathered per-rank times, so every rank reaches the same decision; rank
0 writes it. The decision changes no control flow.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Slowest:
    rank: int
    busy_s: float
    median_busy_s: float

    @property
    def lag_s(self) -> float:
        return self.busy_s - self.median_busy_s

    @property
    def ratio(self) -> float:
        return self.busy_s / self.median_busy_s if self.median_busy_s > 0 else float("inf")

    def fields(self) -> dict:
        ratio = self.ratio if self.median_busy_s > 0 else None
        return {**dataclasses.asdict(self), "lag_s": self.lag_s, "ratio": ratio}


def slowest(busy_s: list[float]) -> Slowest:
    """The busiest rank (the lowest rank among equals) and the median of all ranks' busy times."""
    rank = max(range(len(busy_s)), key=lambda r: (busy_s[r], -r))
    return Slowest(rank, busy_s[rank], statistics.median(busy_s))


class StragglerWatch:
    def __init__(self, factor: float, window: int):
        self.factor, self.window = factor, window
        self.rank: int | None = None  # the rank on a streak
        self.streak = 0

    def update(self, s: Slowest) -> bool:
        """Feed one step's slowest rank; True on the step its streak reaches the window."""
        if s.ratio > self.factor:
            self.streak = self.streak + 1 if s.rank == self.rank else 1
            self.rank = s.rank
        else:
            self.rank, self.streak = None, 0
        return self.streak == self.window
