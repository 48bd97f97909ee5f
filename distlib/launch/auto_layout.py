"""``dist.layout=auto``: python train.py's launcher asks the planner (``scripts/plan.py``'s search) for
the layout to run before any worker starts, and trains that.

Every layout of the keys the command line leaves unset (dist.tp, pp with its schedule, cp, ep,
zero.stage, zero.overlap: ``plan.candidates``) is planned with its per-rank bytes and its step time
predicted (``plan.timing``: on this machine for a CPU run; for a GPU run on the data sheet of the
kind nvidia-smi names, ``plan.devices``, whose memory is then the default budget); the fastest of
those whose step peak (every tensor alive at once: ``plan.step_peak``, run dry) fits
``dist.budget_gb`` is chosen (where the step time is not predicted -- document masks over
context-parallel ranks, a GPU not listed -- the
smallest that fits), written into the configuration with
``dist.layout=given`` -- so the run's record, and a continuation of it, hold the layout that ran --
and said in one line as the overrides that pin it. A budget nothing fits is one ``config error``
line naming the smallest layout's need.
"""

from __future__ import annotations

from distlib.app.config.run import ConfigError
from distlib.app.plan import candidates, devices
from distlib.app.plan.report import (
    GB,
    Planned,
    fastest,
    first_fitting,
    plan,
    with_step_peaks,
)
from distlib.app.plan.timing import Machine
from distlib.app.runtime.devices import on_gpu


def choose(tree: dict, overrides: list[str]) -> tuple[dict, str]:
    """(``tree`` with the chosen layout's keys and ``dist.layout=given``, the line saying so);
    ConfigError when no layout is accepted or none fits the budget."""
    machine, memory_gb, untimed = pricing(tree)
    budget = tree["dist"]["budget_gb"] or memory_gb
    planned, refused = plan(tree, candidates.pinned(overrides), machine)
    if not planned:
        reason = refused[0][1] if refused else "no candidate"
        world = tree["dist"]["world_size"]
        raise ConfigError(f"dist.layout=auto: no layout of dist.world_size={world} is accepted: {reason}")
    fitting = [p for p in planned if p.fits(budget)]
    if not fitting:
        smallest = planned[0]
        what = " ".join(smallest.overrides) or "as given"
        raise ConfigError(
            f"dist.layout=auto: no layout fits dist.budget_gb={budget:g}: the smallest holds "
            f"{smallest.peak / GB:.6g} GB on its fullest rank ({what}); "
            "raise dist.budget_gb or dist.world_size"
        )
    best = fastest(planned, budget)[0]
    chosen, tried = (best, 0) if best is not None else first_fitting(planned, budget)
    if chosen is None:
        raise ConfigError(
            f"dist.layout=auto: no layout fits dist.budget_gb={budget:g} in its step: the "
            f"{tried} smallest by model states and activations peak above it (the first at "
            f"{with_step_peaks(fitting[0]).need / GB:.6g} GB on its fullest rank); "
            "raise dist.budget_gb or dist.world_size"
        )
    return pinned_tree(tree, chosen), said(chosen, best is not None, len(fitting), budget, machine, untimed)


def pricing(tree: dict) -> tuple[Machine | None, float | None, str]:
    """What the steps are priced on, the GPU's memory (GB) and why they are not: this machine
    (measured now) for a CPU run; for a GPU run the data sheet of the kind ``nvidia-smi`` names,
    or None for another GPU."""
    if not on_gpu(tree["train"]["device"], tree["dist"]["backend"]):
        return Machine.probe(), None, ""
    kind = devices.local_kind()
    if kind is None:
        listed = ", ".join(devices.KINDS)
        return None, None, f"step time not predicted for this GPU: nvidia-smi names none of {listed}"
    machine = devices.machine(kind, tree["train"]["dtype"], tree["dist"]["world_size"])
    return machine, devices.KINDS[kind].memory_gb, ""


def pinned_tree(tree: dict, chosen: Planned) -> dict:
    """``tree`` with ``chosen``'s keys set and the layout marked as given (the budget, spent on the
    choice, goes with it: a given layout has none)."""
    out = candidates.applied(tree, chosen.changes)
    out["dist"]["layout"], out["dist"]["budget_gb"] = "given", None
    return out


def said(
    chosen: Planned, timed: bool, fitting: int, budget: float | None, machine: Machine | None, untimed: str
) -> str:
    layout = " ".join(chosen.overrides) or "(the command line's own)"
    within = "" if budget is None else f" within dist.budget_gb={budget:g}"
    if timed:
        ms = 1e3 * chosen.time.total_s
        how = f"predicted fastest on {machine.name} ({ms:.1f} ms a step) of {fitting} layouts{within}"
    else:
        why = untimed or "step time not predicted for these layouts"
        how = f"the smallest of {fitting} layouts{within} ({why})"
    peak = chosen.step_peak
    step = "" if peak is None else f", its step peaking at {peak / GB:.6g} GB"
    return f"dist.layout=auto: {layout}, {how}{step}; add these overrides to pin it"
