"""What the capstone prints, and the four invariants it checks.

Every rank holds the same RunResult (losses and per-rank vectors were shared
through collectives), so every rank reaches the same verdict; only rank 0 prints.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from distlib.app.observe.results import RunResult

TABLE_ROWS = 20  # the end-of-run table's steps at most (about); metrics.jsonl keeps every step


def shown_steps(steps: list) -> tuple[list, int]:
    """The rows of the table: every step of a short run; of a longer one the first, every K-th and
    the last (K the smallest stride that keeps them near TABLE_ROWS), and the evaluated steps when
    they are as few. Returns (rows, K)."""
    every = -(-len(steps) // TABLE_ROWS)
    if every <= 1:
        return list(steps), 1
    evaluated = [s for s in steps if s.val_loss is not None]
    show_val = len(evaluated) <= TABLE_ROWS
    last = len(steps) - 1
    rows = [
        s
        for i, s in enumerate(steps)
        if i in (0, last) or s.step % every == 0 or (show_val and s.val_loss is not None)
    ]
    return rows, every


def loss_table(result: RunResult) -> str:
    """A row per shown step (``shown_steps``); a validation-loss column only when the run evaluated
    (train.eval_every)."""
    with_val = any(s.val_loss is not None for s in result.steps)
    val_head = f"  {'val loss':>10}" if with_val else ""
    lines = [f"{'step':>4}  {'loss':>10}{val_head}  {'grad norm':>10}  {'param norm':>12}  {'ms':>7}"]
    rows, every = shown_steps(result.steps)
    for s in rows:
        val = (f"  {s.val_loss:>10.6f}" if s.val_loss is not None else f"  {'':>10}") if with_val else ""
        lines.append(
            f"{s.step:>4}  {s.loss:>10.6f}{val}  {s.grad_norm:>10.6f}  {s.param_norms[0]:>12.6f}  "
            f"{1000 * s.seconds:>7.1f}"
        )
    if every > 1:
        lines.append(
            f"({len(rows)} of {len(result.steps)} steps shown, one in {every}; all in the metrics file)"
        )
    return "\n".join(lines)


def memory_table(result: RunResult, stage: int) -> str:
    """Measured peak bytes per rank next to the stage's formula; 'match' means formula <=
    measured <= formula + the documented buffers (padding, bucket, gathered block)."""
    n = len(result.memory)
    first = result.memory[0]
    formula = first.get("formula", {})
    # under dist.ep two groups, each with its own P and N (the formula names them)
    grouped = str(formula.get("params", "")).startswith("dense ")
    sizes = (
        "P and N of each group: the dense parameters over the batch ranks, the experts over the ranks "
        "holding them"
        if grouped
        else f"P={result.numel} parameters per rank, N = data-parallel ranks"
    )
    lines = [
        f"memory per rank: peak bytes of the live tensors, ZeRO stage {stage}, {sizes}",
        f"  formula: params {formula.get('params', '?')}, grads {formula.get('grads', '?')}, "
        f"optimizer {formula.get('optimizer', '?')}",
        f"{'rank':>4}  {'params B':>9} {'formula':>9}  {'grads B':>9} {'formula':>9}  "
        f"{'optim B':>9} {'formula':>9}  match",
    ]
    for row in result.memory:
        m, e = row["measured"], row["expected"]
        cells = "  ".join(f"{m[k]:>9} {e[k]:>9.0f}" for k in ("params", "grads", "optimizer"))
        lines.append(f"{row['rank']:>4}  {cells}  {'yes' if _memory_ok(row) else 'NO'}")
    allowance = first["allowance"]
    lines.append(
        "  allowed above the P terms: "
        + ", ".join(f"{k} {allowance[k]:.0f} B" for k in ("params", "grads", "optimizer"))
        + " (padding; bucket / gathered unit; one parameter's gradient)"
    )
    totals = [row["measured"]["optimizer"] for row in result.memory]
    lines.append(f"optimizer bytes across ranks: max {max(totals)}, mean {sum(totals) / n:.1f}")
    kept = [row["measured"].get("activations") for row in result.memory]
    if None not in kept:  # measured by the trainer's ActivationMeter (distlib/app/observe/activations.py)
        lines.append(
            f"activation bytes kept for backward (largest forward) per rank: {', '.join(map(str, kept))}; "
            f"max {max(kept)}, mean {sum(kept) / n:.1f}"
        )
    peaks = [row["measured"].get("step_peak") for row in result.memory]
    if None not in peaks:  # metrics.step_peak: every tensor alive at once (distlib/app/observe/live_bytes.py)
        lines.append(
            "step peak (every tensor alive at once, batches to update) per rank: "
            f"{', '.join(map(str, peaks))}; max {max(peaks)}, mean {sum(peaks) / n:.1f}"
        )
    return "\n".join(lines)


def _memory_ok(row: dict) -> bool:
    return all(0 <= row["measured"][k] - row["expected"][k] <= row["allowance"][k] for k in row["expected"])


def loss_rise(result: RunResult, loss_tolerance: float, monotone_until_step: int) -> str | None:
    """The first step (up to ``monotone_until_step``) whose loss exceeds the previous one's."""
    window = [s for s in result.steps if s.step <= monotone_until_step]
    for prev, cur in zip(window, window[1:]):
        if cur.loss > prev.loss * (1 + loss_tolerance):
            return f"step {cur.step} loss {cur.loss!r} > step {prev.step} loss {prev.loss!r}"
    return None


def loss_warning(
    result: RunResult, loss_tolerance: float, monotone_until_step: int, departures: list[str]
) -> str | None:
    """A rising loss in a run that changed the capstone's model, data or learning: a warning line,
    not a failure (a falling loss is a property of the capstone's data and learning rate)."""
    rise = loss_rise(result, loss_tolerance, monotone_until_step)
    if rise is None or not departures:
        return None
    changed = ", ".join(departures[:4]) + (", ..." if len(departures) > 4 else "")
    return (
        f"warning: the loss rose: {rise} (invariant 1 binds the capstone's model, data and learning "
        f"rate; this run sets {changed})"
    )


def check_invariants(
    result: RunResult, loss_tolerance: float, monotone_until_step: int, departures: list[str] = ()
) -> list[str]:
    """The specification's four invariants; returns one message per violation. Invariant 1 (the
    loss falls) only for a run with the capstone's model, data and learning (no ``departures``)."""
    failures = []
    rise = loss_rise(result, loss_tolerance, monotone_until_step)
    if rise is not None and not departures:
        failures.append(f"invariant 1 (monotone loss): {rise}")
    for s in result.steps:
        if len(set(s.param_norms)) != 1:
            failures.append(
                f"invariant 2 (same parameter norm on every rank): step {s.step} norms {s.param_norms}"
            )
            break
    for row in result.memory:
        if not _memory_ok(row):
            failures.append(
                f"invariant 3 (memory formula): rank {row['rank']} measured {row['measured']} "
                f"vs formula {row['expected']} (+ padding {row['allowance']})"
            )
    if result.resume_check is not None and not result.resume_check.ok:
        failures.append(
            f"invariant 4 (byte-identical restore) of step {result.resume_check.step}: "
            + "; ".join(result.resume_check.mismatches)
        )
    return failures


def _order(manifest: dict) -> list[str]:
    """The dimensions of a checkpoint's rank order, slowest first (older manifests: pp, dp, tp)."""
    return manifest.get("parallel", {}).get("order", ["pp", "dp", "tp"])


def manifest_text(manifest: dict) -> str:
    """The manifest, readably: header, the flat layout one parameter a line, the files."""
    layout = manifest["layout"]
    lines = [
        f"checkpoint manifest: step {manifest['step']}, world size {manifest['world_size']}, "
        f"ZeRO stage {manifest['zero_stage']}, format {manifest['format_version']}",
        f"  model: {json.dumps(manifest['model'])}",
    ]
    if manifest.get("tp", 1) > 1:
        lines.append(
            f"  mesh: {manifest['dp']} data-parallel x {manifest['tp']} tensor-parallel "
            f"(rank order {' > '.join(_order(manifest))}); tensor rank 0's layout below, every rank's in "
            f"tp_layouts"
        )
    lines += [
        f"  flat layout: {layout['numel']} parameters + {layout['padding']} padding = "
        f"{layout['padded_numel']} {layout['dtype']}, {layout['shard_numel']} per rank",
        f"  {'offset':>8}  {'numel':>6}  {'shape':<10}  name",
    ]
    for p in layout["params"]:
        lines.append(
            f"  {p['offset']:>8}  {p['numel']:>6}  {'x'.join(map(str, p['shape'])):<10}  {p['name']}"
        )
    for held in manifest.get("group_holdings", []):  # expert parallelism: each expert rank's experts
        first = ", ".join(p["name"] for p in held["layout"]["params"][:2])
        lines.append(
            f"  {held['prefix']} holding of tensor rank {held['tp_rank']}: {held['layout']['numel']} "
            f"parameters ({first}, ...) over files {held['files']}"
        )
    lines.append(f"  {'file':<22}  {'bytes':>8}  sha256")
    for f in manifest["files"] + manifest.get("extra_files", []):  # the shards, then run-level files
        lines.append(f"  {f['path']:<22}  {f['bytes']:>8}  {f['sha256']}")
    return "\n".join(lines)


def write_json(result: RunResult, failures: list[str], path: Path) -> None:
    """The whole result (every step's per-rank norms, memory rows, resume check) for tools and tests."""
    payload = dataclasses.asdict(result)
    payload["invariant_failures"] = failures
    path.write_text(json.dumps(payload, indent=1))


def print_run(result: RunResult, failures: list[str], zero_stage: int, run_dir: str, world_size: int) -> None:
    """What rank 0 prints at the end of a run: the tables, the first manifest, the resume verdict
    (``RESUME VERIFIED`` only after a real byte comparison), and any broken invariant (stderr)."""
    print(f"run directory: {run_dir}")
    print(loss_table(result))
    print(memory_table(result, zero_stage))
    for manifest in result.manifests[:1]:
        print(manifest_text(manifest))
    if result.stopped_by:
        last = result.steps[-1].step if result.steps else 0
        print(
            f"stopped by {result.stopped_by} after step {last}: checkpoint saved; continue with "
            f"checkpoint.resume=latest hydra.run.dir={run_dir}"
        )
    elif result.resume_check is None:
        print(
            "resume check: not run (no checkpoint saved, or off: checkpoint.verify_resume=true turns it on "
            "for a run that changed the capstone's model, data or learning)"
        )
    elif result.resume_check.ok:
        print(f"step-{result.resume_check.step} checkpoint reloaded byte-identical on all {world_size} ranks")
        print("RESUME VERIFIED")
    for failure in failures:
        print(f"INVARIANT FAILED: {failure}", file=sys.stderr)
    sys.stdout.flush()
