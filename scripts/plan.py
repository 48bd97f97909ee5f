"""Which layouts a model can run in over dist.world_size ranks, and what each rank will hold.

    .venv/bin/python scripts/plan.py [OVERRIDES...] [plan.budget_gb=G] [plan.device=D] [--layout] [--json]
                                     [--verify K]

OVERRIDES are train.py's Hydra overrides (the model, dist.world_size, the batch, train.dtype ...).
Every layout of the searched keys (dist.tp, dist.pp with its schedule, dist.cp, dist.ep, dist.sp,
train.grad_accum, model.activation_checkpointing, zero.stage, zero.overlap; those the command line
sets stay as set) that the configuration accepts is listed with its fullest rank's parameter,
gradient and optimizer bytes -- the end-of-run memory table's figures, predicted without starting a
process (docs/parallelism.md, "Planning") -- smallest first, its predicted step time, and whether it
fits plan.budget_gb per rank; then the smallest and the fastest that fit, with their step peak:
every tensor alive at once, from a whole step run on the meta device, held against the budget (the
table's "fits" holds the states and activations kept against it; docs/parallelism.md, "The step's
peak"). The step is priced on this machine (plan.device=cpu, measured at start) or on a GPU kind's
data sheet (plan.device=a100, h100 or h200: one GPU per rank; plan.budget_gb then defaults to its
memory; distlib/app/plan/devices.py says what is assumed). --layout: only the command line's own
layout, rank by rank, with its step peak. --json: the same as JSON on stdout. The activations kept
for backward, the step peak and the step time are predicted for dense models and, with balanced
expert loads, for models with experts (an estimate over expert-parallel ranks); not for document
masks over context-parallel ranks: there the verdict says it covers the model states only.
--verify K: train the K smallest layouts and a seeded sample of K others (with --layout: the one)
for a few steps each with train.py, and say for each whether every rank measured what was planned
(exit status 1 if any did not), and its measured step time and step peak beside the predicted
ones, with the rank correlation of the step times over the layouts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distlib.app.config.run import ConfigError, RunConfig  # noqa: E402
from distlib.app.plan import candidates, devices  # noqa: E402
from distlib.app.plan.activations import bounded  # noqa: E402
from distlib.app.plan.report import (  # noqa: E402
    GB,
    Planned,
    fastest,
    first_fitting,
    plan,
    planned,
    table,
    with_step_peaks,
)
from distlib.app.plan.timing import Machine  # noqa: E402
from distlib.launch import plan_verify  # noqa: E402


def parse(argv: list[str]) -> tuple[list[str], float | None, dict]:
    """(Hydra overrides, plan.budget_gb or None, the flags: layout, json, verify K or None, and
    plan.device)."""
    budget, hydra, flags = None, [], {"layout": False, "json": False, "verify": None, "device": "cpu"}
    words = iter(argv)
    for arg in words:
        if arg.startswith("plan.budget_gb="):
            budget = _budget(arg.split("=", 1)[1])
        elif arg.startswith("plan.device="):
            flags["device"] = _device(arg.split("=", 1)[1])
        elif arg.startswith("plan."):
            key = arg.split("=", 1)[0]
            raise SystemExit(
                f"error: unknown planner key {key} (plan.budget_gb and plan.device are the planner's)"
            )
        elif arg in ("--layout", "--json"):
            flags[arg[2:]] = True
        elif arg == "--verify":
            flags["verify"] = _count(next(words, ""))
        else:
            hydra.append(arg)
    return hydra, budget, flags


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise SystemExit(f"error: --verify takes how many layouts to run (a whole number >= 1), got {text!r}")
    return int(text)


def _device(text: str) -> str:
    if text not in devices.DEVICES:
        raise SystemExit(f"error: plan.device must be one of {', '.join(devices.DEVICES)}, got {text!r}")
    return text


def _machine(tree: dict, device: str) -> Machine:
    """What the step is priced on: this machine (measured), or a GPU kind's data sheet."""
    if device == "cpu":
        return Machine.probe()
    return devices.machine(device, tree["train"]["dtype"], tree["dist"]["world_size"])


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SystemExit(f"error: plan.budget_gb must be a positive number of GB per rank, got {text!r}")
    return value


def compose(hydra: list[str]) -> dict:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from distlib.launch.hydra_config import compose_tree, missing_choice

    wrong = missing_choice(hydra)
    if wrong:
        raise SystemExit(f"error: {wrong}")
    try:
        return compose_tree(hydra)
    except (HydraException, OmegaConfBaseException) as exc:
        raise SystemExit(f"error: {str(exc).splitlines()[0]}") from None


def one_layout(
    tree: dict, budget: float | None, doc: dict | None, machine: Machine
) -> tuple[int, list[Planned]]:
    """The command line's layout rank by rank and its verdict (into ``doc`` when JSON is asked for)."""
    try:
        cfg = RunConfig.from_dict(tree)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    layout = with_step_peaks(planned(cfg, [], machine))
    if doc is not None:
        doc.update(layout.as_dict(budget))
    else:
        head = f"{'params B':>12} {'grads B':>12} {'optim B':>12} {'activ B':>12} {'total B':>12}"
        print(f"{'rank':>4} {head} {'step peak B':>12}")
        for r, kept, peak in zip(layout.ranks, layout.activations, layout.step_peaks):
            shown, total = "?" if kept is None else kept, layout.total(r.rank)
            row = f"{r.params:>12} {r.grads:>12} {r.optimizer:>12} {shown:>12} {total:>12}"
            print(f"{r.rank:>4} {row} {'?' if peak is None else peak:>12}")
        print(_verdict(layout, budget))
        if layout.time is not None:
            t = layout.time
            print(
                f"predicted step on {machine.name}: {1e3 * t.total_s:.1f} ms ({1e3 * t.compute_s:.1f} "
                f"compute, {1e3 * t.comm_s:.1f} communication, {1e3 * t.bubble_s:.1f} pipeline bubble)"
            )
    return (0 if layout.fits(budget) else 1), [layout]


def _verdict(layout: Planned, budget: float | None) -> str:
    what = "model states and activations" if layout.activations_known else "model states"
    needs = f"the fullest rank holds {layout.peak / GB:.6g} GB of {what}"
    if not layout.exact:
        needs += " (at most: zero.overlap)"
    if layout.step_peak is not None:
        peak = f"the fullest rank's step peaks at {layout.step_peak / GB:.6g} GB (every tensor at once)"
        needs = f"{peak}; {needs}"
    elif layout.step_peaks is not None:
        needs += "; its step's peak not predicted (document masks)"
    if not layout.activations_known:
        needs += "; activations not predicted for this layout (document masks at cp > 1)"
    if layout.cfg is not None and layout.cfg.model.has_experts and layout.step_peak is not None:
        needs += "; with experts the step peak is a bound (the most any routing sends a rank's experts)"
    if layout.cfg is not None and bounded(layout.cfg) and layout.activations_known:
        needs += "; the activations a bound too (the most any routing sends; a capacity: nothing dropped)"
    if budget is None:
        return needs
    word = "fits" if layout.fits(budget) else "does NOT fit"
    return f"{word} plan.budget_gb={budget:g}: {needs}"


def search(
    tree: dict, pinned: set[str], budget: float | None, doc: dict | None, machine: Machine
) -> tuple[int, list[Planned]]:
    """Every accepted layout, smallest first, and the smallest that fits (into ``doc`` for JSON)."""
    planned, refused = plan(tree, pinned, machine)
    if not planned:  # the command line's own layout says why (a world size of 0, a pinned degree)
        raise SystemExit(f"error: no layout is accepted: {_refusal(tree, refused)}")
    fitting = [p for p in planned if p.fits(budget)]
    if doc is not None:
        doc.update(layouts=[p.as_dict(budget) for p in planned], refused=len(refused), budget_gb=budget)
    else:
        print("\n".join(table(planned, budget)))
        print(f"{len(planned)} layouts accepted, {len(refused)} refused by the configuration")
        if budget is not None:
            print(
                "fits: the total (model states and activations kept) within the budget; the layouts "
                "below are held to it by their step's peak (every tensor alive at once)"
            )
    if not fitting:
        best = planned[0]
        print(
            f"error: no layout fits plan.budget_gb={budget:g}: the smallest holds {best.peak / GB:.6g} GB "
            f"on its fullest rank ({' '.join(best.overrides)}); raise plan.budget_gb or dist.world_size",
            file=sys.stderr,
        )
        return 1, planned
    best, tried = first_fitting(planned, budget)
    if best is None:
        print(
            f"error: no layout fits plan.budget_gb={budget:g} in its step: the {tried} smallest by model "
            f"states and activations peak above it (the first: {_peak_of(with_step_peaks(fitting[0]))}); "
            "raise plan.budget_gb or dist.world_size",
            file=sys.stderr,
        )
        return 1, planned
    if doc is None:
        unknown = "" if best.activations_known else " (its activations not predicted)"
        print(f"smallest that fits: {' '.join(best.overrides) or '(as given)'}{unknown}, {_peak_of(best)}")
        print(_fastest_line(planned, budget))
    return 0, planned


def _fastest_line(planned: list[Planned], budget: float | None) -> str:
    quick, tried = fastest(planned, budget)
    if quick is not None:
        what, ms = " ".join(quick.overrides) or "(as given)", 1e3 * quick.time.total_s
        return f"fastest that fits (predicted {ms:.1f} ms a step): {what}, {_peak_of(quick)}"
    if tried == 0:
        return "fastest that fits: not predicted (no layout that fits has a predicted step time)"
    return (
        f"fastest that fits: none of the {tried} fastest whose model states and activations fit fits "
        "in its step; the smallest that fits is the one to run"
    )


def _peak_of(layout: Planned) -> str:
    if layout.step_peak is None:
        return "its step's peak not predicted"
    return f"its step peaking at {layout.step_peak / GB:.6g} GB"


def _refusal(tree: dict, refused: list[tuple[list[str], str]]) -> str:
    """Why the command line's own layout is refused, or else the first candidate's reason."""
    try:
        RunConfig.from_dict(tree)
    except ConfigError as exc:
        return str(exc)
    return refused[0][1] if refused else "no candidate"


def main(argv: list[str]) -> int:
    hydra, budget, flags = parse(argv)
    device = flags["device"]
    if device != "cpu" and flags["verify"] is not None:
        raise SystemExit(f"error: --verify trains on this machine, not on plan.device={device}")
    if device != "cpu" and budget is None:
        budget = devices.KINDS[device].memory_gb  # the GPU's own memory
    tree = compose(hydra)
    machine = _machine(tree, device)
    doc = {} if flags["json"] else None  # one JSON document at the end, verification included
    if doc is not None:
        doc["device"] = machine.name
    if flags["layout"]:
        status, layouts = one_layout(tree, budget, doc, machine)
    else:
        status, layouts = search(tree, candidates.pinned(hydra), budget, doc, machine)
    if flags["verify"] is not None and layouts:
        picked = layouts if flags["layout"] else plan_verify.chosen(layouts, flags["verify"])
        status = max(status, report_verified(plan_verify.verify(hydra, picked), doc))
    if doc is not None:
        print(json.dumps(doc, indent=1))
    return status


def report_verified(results: list[dict], doc: dict | None) -> int:
    """Print each verified layout's verdict and its measured and predicted step times, and the
    rank correlation of the two (JSON: into ``doc``, every rank's measured bytes too); 1 on a miss."""
    timed = [r for r in results if r.get("predicted_step_ms") is not None]
    rho = plan_verify.spearman([r["predicted_step_ms"] for r in timed], [r["step_ms"] for r in timed])
    if doc is not None:
        doc["verified"] = results
        doc["step_time_rank_correlation"] = rho
    else:
        steps = plan_verify.STEPS
        print(
            f"verified on this machine (train.py, {steps} steps each; step ms and the fullest rank's "
            "step peak in bytes: measured / predicted):"
        )
        for r in results:
            what = " ".join(r["overrides"]) or "(as given)"
            figures = f"{_times(r):>15}  {_peaks(r):>21}"
            print(f"  {'as planned' if not r['misses'] else 'MISMATCH':<10}  {figures}  {what}")
            for miss in r["misses"]:
                print(f"              {miss}")
        good = sum(not r["misses"] for r in results)
        print(f"{good} of {len(results)} layouts measured as planned")
        if rho is not None:
            print(
                f"step time: rank correlation of predicted and measured over {len(timed)} layouts {rho:.2f}"
            )
    return 0 if all(not r["misses"] for r in results) else 1


def _times(result: dict) -> str:
    if "step_ms" not in result:
        return "-"
    predicted = result["predicted_step_ms"]
    return f"{result['step_ms']:.1f} / {'?' if predicted is None else f'{predicted:.1f}'}"


def _peaks(result: dict) -> str:
    if "ranks" not in result:
        return "-"
    planned = result["planned_step_peaks"]
    predicted = "?" if planned is None or None in planned else str(max(planned))
    return f"{max(r['step_peak'] for r in result['ranks'])} / {predicted}"


def _quietly_closed() -> int:
    """stdout's reader left (``| head``): stop without a traceback, and without Python's second
    complaint when it flushes stdout at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1


def _run(argv: list[str]) -> int:
    try:
        status = main(argv)
        sys.stdout.flush()  # here, not at exit, where a closed reader is not this code's to catch
    except BrokenPipeError:
        return _quietly_closed()
    return status


if __name__ == "__main__":
    sys.exit(_run(sys.argv[1:]))
