"""The planner's answer: every candidate layout with each rank's predicted model-state bytes,
ranked by its fullest rank, as a table and as JSON, and the verdict against a per-rank budget."""

from __future__ import annotations

from dataclasses import dataclass

from distlib.app.config.run import RunConfig
from distlib.app.plan import candidates
from distlib.app.plan.states import RankStates, model_states

GB = 1e9  # plan.budget_gb is in decimal gigabytes (what a data sheet quotes)


@dataclass(frozen=True)
class Planned:
    overrides: list[str]  # what to add to the command line for this layout
    ranks: list[RankStates]

    @property
    def peak(self) -> int:
        """The fullest rank's parameter, gradient and optimizer bytes together."""
        return max(r.params + r.grads + r.optimizer for r in self.ranks)

    @property
    def exact(self) -> bool:
        return all(r.exact for r in self.ranks)

    def fits(self, budget: float | None) -> bool:
        return budget is None or self.peak <= budget * GB

    def as_dict(self, budget: float | None) -> dict:
        return {
            "overrides": self.overrides,
            "peak_bytes": self.peak,
            "exact": self.exact,
            "fits": self.fits(budget),
            "ranks": [{"rank": r.rank, **r.as_dict()} for r in self.ranks],
        }


def plan(base: dict, pinned: set[str]) -> tuple[list[Planned], list[tuple[list[str], str]]]:
    """Every accepted candidate of ``base`` (a composed tree), fullest rank smallest first, and
    every refused one with the configuration's reason."""
    kept, refused = [], []
    for changed, cfg in candidates.candidates(base, pinned):
        named = candidates.overrides(base, changed)
        if isinstance(cfg, RunConfig):
            kept.append(Planned(named, model_states(cfg)))
        else:
            refused.append((named, str(cfg)))
    kept.sort(key=lambda p: (p.peak, len(p.overrides)))
    return kept, refused


def table(planned: list[Planned], budget: float | None) -> list[str]:
    """One line per layout: the fullest rank's bytes by category, fits or not, the overrides."""
    lines = [f"{'params B':>12} {'grads B':>12} {'optim B':>12} {'total B':>12}  fits  layout"]
    for p in planned:
        fullest = max(p.ranks, key=lambda r: r.params + r.grads + r.optimizer)
        mark = "" if p.exact else " (bound)"
        fits = "yes" if p.fits(budget) else "NO"
        lines.append(
            f"{fullest.params:>12} {fullest.grads:>12} {fullest.optimizer:>12} {p.peak:>12}  {fits:>4}  "
            f"{' '.join(p.overrides) or '(as given)'}{mark}"
        )
    return lines
