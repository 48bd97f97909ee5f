"""The planner's answer: every candidate layout with each rank's predicted model-state and
activation bytes, ranked by its fullest rank, as a table and as JSON, and the verdict against a
per-rank budget: held against the step's peak (every tensor at once, ``step_peak``) for the
layouts shown alone or chosen, against the states and activations kept for the rest."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from dataclasses import dataclass, field

from distlib.app.config.groups import ZeroConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.operation import DistConfig
from distlib.app.config.run import DTYPES, RunConfig
from distlib.app.plan import candidates
from distlib.app.plan.activations import bounded, rank_activations, stage_counts
from distlib.app.plan.states import RankStates, group_shape, model_states, stage_groups
from distlib.app.plan.step_peak import rank_step_peaks
from distlib.app.plan.timing import Counted, Machine, StepTime, grouped, merged, step_time, times
from distlib.comm.layout import BATCH
from distlib.parallel.zero.predict import sync_parts

GB = 1e9  # plan.budget_gb is in decimal gigabytes (what a data sheet quotes)


@dataclass(frozen=True)
class Planned:
    overrides: list[str]  # what to add to the command line for this layout
    ranks: list[RankStates]
    activations: list[int | None]  # per rank, bytes kept for backward (None: not predicted)
    time: StepTime | None = None  # predicted (None: not asked for, or not predicted)
    changes: dict = field(default_factory=dict)  # the searched keys it sets ({"dist.tp": 2, ...})
    cfg: RunConfig | None = field(default=None, repr=False, compare=False)
    # per rank, every tensor alive at once during the step (``step_peak``; None: not predicted);
    # a whole dry step each, so only for the layouts shown alone or chosen (``with_step_peaks``)
    step_peaks: list[int | None] | None = None

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
    def step_peak(self) -> int | None:
        """The fullest rank's step peak, where predicted for every rank."""
        if self.step_peaks is None or None in self.step_peaks:
            return None
        return max(self.step_peaks)

    @property
    def need(self) -> int:
        """What the budget is held against: the step peak where known, else states and activations."""
        return self.peak if self.step_peak is None else self.step_peak

    @property
    def exact(self) -> bool:
        return all(r.exact for r in self.ranks)

    @property
    def activations_known(self) -> bool:
        return None not in self.activations

    def fits(self, budget: float | None) -> bool:
        return budget is None or self.need <= budget * GB

    def as_dict(self, budget: float | None) -> dict:
        peaks = self.step_peaks or [None] * len(self.ranks)
        return {
            "overrides": self.overrides,
            "peak_bytes": self.peak,
            "exact": self.exact,
            "fits": self.fits(budget),
            "step_peak_bytes": self.step_peak,
            "ranks": [
                {**r.as_dict(), "activations": a, "step_peak": s}
                for r, a, s in zip(self.ranks, self.activations, peaks)
            ],
            "time": None if self.time is None else self.time.as_dict(),
        }


def planned(
    cfg: RunConfig, overrides: list[str], machine: Machine | None = None, changes: dict | None = None
) -> Planned:
    """``cfg``'s layout with every rank's predicted bytes, and with ``machine`` its step time."""
    time = None if machine is None else predicted_time(cfg, machine)
    return Planned(overrides, model_states(cfg), rank_activations(cfg), time, dict(changes or {}), cfg)


def with_step_peaks(layout: Planned) -> Planned:
    """``layout`` with every rank's step peak predicted (``step_peak``: a whole dry step per stage)."""
    if layout.step_peaks is not None:
        return layout
    return dataclasses.replace(layout, step_peaks=rank_step_peaks(layout.cfg))


# The most layouts whose step is run dry to find one that fits (40-140 ms each for the presets).
CONFIRM_AT_MOST = 20


def first_fitting(ordered: list[Planned], budget: float | None) -> tuple[Planned | None, int]:
    """The first of ``ordered`` whose step peak fits ``budget`` (where not predicted, its model
    states and activations), trying those whose states and activations fit, at most
    ``CONFIRM_AT_MOST`` of them; and how many were tried."""
    tried = 0
    for layout in ordered:
        if tried == CONFIRM_AT_MOST:
            break
        if layout.fits(budget):
            tried += 1
            confirmed = with_step_peaks(layout)
            if confirmed.fits(budget):
                return confirmed, tried
    return None, tried


# the trainer's verdict on each step: an all-gather of each rank's loss and grad norm (float64) over
# the world (guard.check_step). Not counted: the grad norm's own all-gather of one sum of squares
# per rank over the data-parallel group (one meeting more a step, in every layout)
VERDICT_BYTES_PER_RANK = 16


def predicted_time(cfg: RunConfig, machine: Machine) -> StepTime | None:
    """``cfg``'s step on ``machine`` (``timing``): each stage's dry step with its ZeRO groups'
    collectives and the verdict added; None where the dry step is not predicted."""
    counts = stage_counts(cfg)
    if counts is None:
        return None
    stages, world = [], cfg.dist.world_size
    for stage, counted in enumerate(counts):
        per_micro_batch, per_step, elements = _zero_calls(
            cfg.model, group_shape(cfg.dist), cfg.zero, cfg.train.dtype, stage
        )
        verdict = (("all_gather", VERDICT_BYTES_PER_RANK * world, world, 1),)
        calls = merged(
            counted.calls, times(per_micro_batch, cfg.train.grad_accum), per_step, verdict, _bias_update(cfg)
        )
        stages.append((Counted(counted.flops, counted.ops, counted.written, calls), elements))
    tokens = cfg.global_batch * cfg.model.seq_len
    d = cfg.dist
    stage_ranks = cfg.layout.stage().world_size
    return step_time(
        stages, d.world_size, stage_ranks, cfg.train.grad_accum, d.pp_virtual, tokens, machine, d.transport
    )


def _bias_update(cfg: RunConfig) -> tuple:
    """``model.balance=bias``: after the update, the step's counts of each expert (float64, per MoE
    block) summed over the batch ranks and the pipeline's stages (``BiasBalance.update``)."""
    model = cfg.model
    if not (model.has_experts and model.balance == "bias"):
        return ()
    nbytes = 8 * len(model.moe_layers) * model.n_experts
    sizes = (len(cfg.layout.group(0, BATCH)), cfg.dist.pp)
    return grouped(("all_reduce", nbytes, n) for n in sizes if n > 1)


@functools.lru_cache(maxsize=4096)
def _zero_calls(model: ModelConfig, dist: DistConfig, z: ZeroConfig, dtype: str, stage: int) -> tuple:
    """Pipeline stage ``stage``'s ZeRO collectives, as grouped (kind, bytes, group size, times):
    those of every micro-batch and those of the step, each with a wake-up of the communication
    thread under ``zero.overlap``; and the optimizer's elements on its first rank (its update's
    work)."""
    per_micro_batch, per_step, elements = [], [], 0
    for module, flat, segments in stage_groups(model, dist, stage):
        n = flat.world_size
        if n > 1:
            parts = sync_parts(z.stage, module, flat, DTYPES[dtype], z.bucket_numel, z.overlap, segments)
            for calls, synced in zip((per_micro_batch, per_step), parts):
                calls += [(kind, nbytes, n) for kind, nbytes in synced]
                calls += [("handoff", 0, n)] * (len(synced) if z.overlap else 0)
        elements += flat.padded_numel if z.stage == 0 else flat.shard_numel
    return grouped(per_micro_batch), grouped(per_step), elements


def plan(
    base: dict, pinned: set[str], machine: Machine | None = None
) -> tuple[list[Planned], list[tuple[list[str], str]]]:
    """Every accepted candidate of ``base`` (a composed tree), fullest rank smallest first (those
    whose activations are predicted before those whose are not), and every refused one with the
    configuration's reason."""
    kept, refused = [], []
    with _collector_paused():
        for changed, cfg in candidates.candidates(base, pinned):
            named = candidates.overrides(base, changed)
            if isinstance(cfg, RunConfig):
                kept.append(planned(cfg, named, machine, changed))
            else:
                refused.append((named, str(cfg)))
    # where the activations are predicted the whole is known: those first, each part smallest first
    kept.sort(key=lambda p: (not p.activations_known, p.peak, len(p.overrides)))
    return kept, refused


@contextlib.contextmanager
def _collector_paused():
    """The search makes many small objects that live until it ends (configurations, plans, cached
    runs): the cyclic collector's passes over them free nothing and take a tenth of it (llama's
    1,008 layouts over 4 ranks: 1.80 s, 1.60 s paused; medians of four)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def table(planned: list[Planned], budget: float | None) -> list[str]:
    """One line per layout: the fullest rank's bytes by category, the predicted step time ("?":
    not predicted), fits or not, the overrides."""
    head = f"{'params B':>12} {'grads B':>12} {'optim B':>12} {'activ B':>12} {'total B':>12}"
    lines = [f"{head} {'step ms':>8}  fits  layout"]
    for p in planned:
        r, kept = p.ranks[p.fullest], p.activations[p.fullest]
        mark = "" if p.exact else " (bound)"
        mark += "" if p.activations_known else " (activations not predicted)"
        mark += " (activations a bound: experts)" if p.activations_known and bounded(p.cfg) else ""
        fits = "yes" if p.fits(budget) else "NO"
        ms = "?" if p.time is None else f"{1e3 * p.time.total_s:.1f}"
        lines.append(
            f"{r.params:>12} {r.grads:>12} {r.optimizer:>12} {'?' if kept is None else kept:>12} "
            f"{p.peak:>12} {ms:>8}  {fits:>4}  {' '.join(p.overrides) or '(as given)'}{mark}"
        )
    return lines


def fastest(planned: list[Planned], budget: float | None) -> tuple[Planned | None, int]:
    """The layout predicted fastest among those whose step peak fits (None: none fits, or none is
    timed), from the fastest of those whose states and activations fit (``first_fitting``); and how
    many were tried."""
    timed = sorted((p for p in planned if p.time is not None), key=lambda p: p.time.total_s)
    return first_fitting(timed, budget)
