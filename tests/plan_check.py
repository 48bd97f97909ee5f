"""The planner's prediction against a run's measurement: every matrix that trains layouts (the
families', the pipeline schedules', context, sequence and expert parallelism's, DeepSeek-V3's, the
MoE pipeline's) hands its runs here, so every layout they train checks ``scripts/plan.py``'s figures
at no extra training (issue 42's rule)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from distlib.app.config.run import RunConfig
from distlib.app.plan import activations, step_peak
from distlib.app.plan.states import model_states

CATEGORIES = ("params", "grads", "optimizer")
# one quiet metered step over 4 ranks: what the planner's matrices train each layout for (``measure``)
ONE_STEP = ["train.steps=1", "optimizer.warmup_steps=0", "checkpoint.every_steps=0"]
ONE_STEP += ["checkpoint.verify_resume=false", "metrics.progress_every=0", "dist.world_size=4"]
ONE_STEP += ["metrics.step_peak=true"]


def planner_misses(tree: dict, measured: list[dict]) -> list[str]:
    """Each rank and category where ``measured`` (the memory table's rows, rank order) is not the
    planner's figure for ``tree``: equal to the byte, or, where the planner gives a bound
    (zero.overlap at stages 2/3), above it or empty; the activations kept for backward equal to the
    byte where the planner predicts them."""
    cfg = RunConfig.from_dict(tree)
    predicted = model_states(cfg)
    misses = (
        []
        if len(predicted) == len(measured)
        else [f"{len(measured)} ranks measured, {len(predicted)} planned"]
    )
    for got, want in zip(measured, predicted):
        for category in CATEGORIES:
            m, p = got[category], getattr(want, category)
            if (m != p) if want.exact else not 0 < m <= p:
                bound = "" if want.exact else " at most"
                misses.append(f"rank {want.rank} {category}: measured {m}, planned{bound} {p}")
    for rank, (got, kept) in enumerate(zip(measured, activations.rank_activations(cfg))):
        if kept is not None and activations.missed(cfg, got["activations"], kept):
            misses.append(f"rank {rank} activations: measured {got['activations']}, planned {kept}")
    return misses + _step_peak_misses(cfg, measured)


def _step_peak_misses(cfg: RunConfig, measured: list[dict]) -> list[str]:
    """Where a run with ``metrics.step_peak`` measured another peak than the dry step's
    (``step_peak.missed``: equal to the byte, or at most a bound: with zero.overlap at stages 2/3,
    the communication thread's timing; with experts)."""
    if "step_peak" not in measured[0]:
        return []
    out = []
    for rank, (got, want) in enumerate(zip(measured, step_peak.rank_step_peaks(cfg))):
        m = got["step_peak"]
        if want is not None and step_peak.missed(cfg, m, want):
            out.append(f"rank {rank} step peak: measured {m}, planned {want}")
    return out


def matrix_misses(runs) -> dict[str, list[str]]:
    """``planner_misses`` of every run of a matrix (each a ``trainrun.train_each`` view), by layout."""
    out = {}
    for i, run in enumerate(runs):
        misses = planner_misses(run["tree"], run["memory"])
        if misses:
            out[f"run {i}: {_name(run['tree'])}"] = misses
    return out


def _name(tree: dict) -> str:
    d, z = tree["dist"], tree["zero"]
    dims = " ".join(f"{k}{d[k]}" for k in ("world_size", "tp", "pp", "cp", "ep"))
    options = f"zero{z['stage']} overlap {z['overlap']} {tree['train']['dtype']}"
    return f"{tree['model']['family']} {dims} {options}"


def measure(comm, trees: list[dict], root: str) -> list[list[dict]]:
    """On a rank of ``comm``: each tree trained in turn (under ``root``, quietly); per tree, every
    rank's measured bytes (the end-of-run memory table's rows)."""
    from distlib.app.trainer import Trainer
    from distlib.launch.torchrun import use_deterministic_kernels

    use_deterministic_kernels()
    out = []
    for i, tree in enumerate(trees):
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            result = Trainer(RunConfig.from_dict(tree), comm, Path(root) / str(i)).run()
        out.append([row["measured"] for row in result.memory])
    return out
