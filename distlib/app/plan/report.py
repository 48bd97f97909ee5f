"""The planner's answer: every candidate layout with each rank's predicted model-state and
activation bytes, ranked by its fullest rank, as a table and as JSON, and the verdict against a
per-rank budget."""

from __future__ import annotations

from dataclasses import dataclass

from distlib.app.config.run import RunConfig
from distlib.app.plan import candidates
from distlib.app.plan.activations import rank_activations
from distlib.app.plan.states import RankStates, model_states

GB = 1e9  # plan.budget_gb is in decimal gigabytes (what a data sheet quotes)


@dataclass(frozen=True)
class Planned:
    overrides: list[str]  # what to add to the command line for this layout
    ranks: list[RankStates]
    activations: list[int | None]  # per rank, bytes kept for backward (None: not predicted)

    def total(self, rank: int) -> int:
        """Rank ``rank``'s model states and (where predicted) activations, in bytes."""
        r = self.ranks[rank]
        return r.params + r.grads + r.optimizer + (self.activations[rank] or 0)

    @property
    def fullest(self) -> int:
        return max(range(len(self.ranks)), key=self.total)

    @property
    def peak(self) -> int:
        """The fullest rank's bytes: model states and the activations kept for backward."""
        return self.total(self.fullest)

    @property
    def exact(self) -> bool:
        return all(r.exact for r in self.ranks)

    @property
    def activations_known(self) -> bool:
        return None not in self.activations

    def fits(self, budget: float | None) -> bool:
        return budget is None or self.peak <= budget * GB

    def as_dict(self, budget: float | None) -> dict:
        return {
            "overrides": self.overrides,
            "peak_bytes": self.peak,
            "exact": self.exact,
            "fits": self.fits(budget),
            "ranks": [{**r.as_dict(), "activations": a} for r, a in zip(self.ranks, self.activations)],
        }


def planned(cfg: RunConfig, overrides: list[str]) -> Planned:
    """``cfg``'s layout with every rank's predicted bytes."""
    return Planned(overrides, model_states(cfg), rank_activations(cfg))


def plan(base: dict, pinned: set[str]) -> tuple[list[Planned], list[tuple[list[str], str]]]:
    """Every accepted candidate of ``base`` (a composed tree), fullest rank smallest first (those
    whose activations are predicted before those whose are not), and every refused one with the
    configuration's reason."""
    kept, refused = [], []
    for changed, cfg in candidates.candidates(base, pinned):
        named = candidates.overrides(base, changed)
        if isinstance(cfg, RunConfig):
            kept.append(planned(cfg, named))
        else:
            refused.append((named, str(cfg)))
    # where the activations are predicted the whole is known: those first, each part smallest first
    kept.sort(key=lambda p: (not p.activations_known, p.peak, len(p.overrides)))
    return kept, refused


def table(planned: list[Planned], budget: float | None) -> list[str]:
    """One line per layout: the fullest rank's bytes by category, fits or not, the overrides."""
    head = f"{'params B':>12} {'grads B':>12} {'optim B':>12} {'activ B':>12} {'total B':>12}  fits  layout"
    lines = [head]
    for p in planned:
        r, kept = p.ranks[p.fullest], p.activations[p.fullest]
        mark = "" if p.exact else " (bound)"
        mark += "" if p.activations_known else " (activations not predicted)"
        fits = "yes" if p.fits(budget) else "NO"
        lines.append(
            f"{r.params:>12} {r.grads:>12} {r.optimizer:>12} {'?' if kept is None else kept:>12} "
            f"{p.peak:>12}  {fits:>4}  {' '.join(p.overrides) or '(as given)'}{mark}"
        )
    return lines
