"""The layouts a model can run in over a world size: every combination of the dimensions and the
ZeRO options that decide what each rank holds, kept where the configuration accepts it.

Searched (each unless the command line sets it): dist.tp, dist.pp, dist.cp and, for a model with
experts, dist.ep, over the divisors of the world size; dist.sp where tp > 1; the pipeline's
schedule (1f1b, gpipe, interleaved with 2 chunks per rank); the micro-batches a step
(train.grad_accum, over the divisors of train.global_batch: the micro-batch's rows follow);
model.activation_checkpointing; zero.stage 0-3 and zero.overlap. Everything else (the global
batch, the dtype, bucket sizes, the model) is the command line's. A candidate the configuration refuses
(a degree that does not divide the heads, a pipeline deeper than the blocks, ...) is dropped with
the reason ``RunConfig.from_dict`` gives.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator

from distlib.app.config.model_group import EXPERT_FAMILIES
from distlib.app.config.run import ConfigError, RunConfig

# the schedules tried at pp > 1 (interleaved with two chunks per rank)
PIPELINE = ({"pp_schedule": "1f1b"}, {"pp_schedule": "gpipe"})
PIPELINE += ({"pp_schedule": "interleaved", "pp_virtual": 2},)
SEARCHED = ("dist.tp", "dist.pp", "dist.cp", "dist.ep", "dist.sp", "dist.pp_schedule", "dist.pp_virtual")
SEARCHED += ("train.grad_accum", "model.activation_checkpointing", "zero.stage", "zero.overlap")
# a group whose file a command line chooses (zero=stage3) fixes its searched keys; a model file
# picks the model, not how its activations are kept
PINNED_BY_FILE = ("dist", "train", "zero")


def pinned(overrides: list[str]) -> set[str]:
    """The searched keys a command line fixes: each it names (``dist.tp=2``), and every one of a
    group it chooses a file of (``zero=stage3`` fixes zero.stage and zero.overlap)."""
    named = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    by_file = {group for group in PINNED_BY_FILE if group in named}
    return {key for key in SEARCHED if key in named or key.split(".")[0] in by_file}


def candidates(base: dict, fixed: set[str]) -> Iterator[tuple[dict, RunConfig | ConfigError]]:
    """Each candidate's changed keys ({"dist.tp": 2, ...}) with its checked configuration, or the
    ConfigError refusing it; ``fixed``: the dotted keys the command line set (``pinned``)."""
    world, batch = base["dist"]["world_size"], base["train"]["global_batch"]
    divisors = _divisors(world)
    experts = base["model"]["family"] in EXPERT_FAMILIES  # (the tree is checked per candidate)
    parsed = _groups(base)

    def choices(key: str, values) -> list[dict]:
        return [{}] if key in fixed else [{key: v} for v in values]

    dims = [
        choices("dist.tp", divisors),
        choices("dist.pp", divisors),
        choices("dist.cp", divisors),
        choices("dist.ep", divisors if experts else [1]),
        choices("dist.sp", (False, True)),
        choices("train.grad_accum", _divisors(batch) if batch else [1]),
        choices("model.activation_checkpointing", ("none", "blocks")),
        choices("zero.stage", (0, 1, 2, 3)),
        choices("zero.overlap", (False, True)),
    ]
    for picked in itertools.product(*dims):
        keys = {k: v for part in picked for k, v in part.items()}
        degree = {d: keys.get(f"dist.{d}", base["dist"][d]) for d in ("tp", "pp", "cp")}
        if world % (degree["tp"] * degree["pp"] * degree["cp"]):
            continue  # not a grid of this world (no need to ask the configuration)
        if keys.get("dist.sp") and degree["tp"] == 1:
            continue  # sequence parallelism splits over the tensor-parallel ranks: none to split over
        pp = degree["pp"]
        schedules = [{}] if pp == 1 or "dist.pp_schedule" in fixed else PIPELINE
        for schedule in schedules:
            changed = keys | {f"dist.{k}": v for k, v in schedule.items()}
            yield changed, _checked(parsed, base, changed)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def applied(base: dict, changed: dict) -> dict:
    """A copy of the tree ``base`` with a candidate's ``changed`` keys set."""
    tree = copy.deepcopy(base)
    for key, value in changed.items():
        group, name = key.split(".")
        tree.setdefault(group, {})[name] = value
    return tree


def _groups(base: dict) -> RunConfig | ConfigError:
    try:
        return RunConfig.groups_from_dict(base)
    except ConfigError as exc:
        return exc


def _checked(parsed: RunConfig | ConfigError, base: dict, changed: dict) -> RunConfig | ConfigError:
    """The candidate's configuration, from the base's checked groups (a seventh of the time of
    checking the whole tree again: 0.055 s for llama's 1,920 candidates at 4 ranks), or the
    ConfigError refusing it."""
    try:
        if isinstance(parsed, ConfigError):  # the tree's own groups are refused: say so per candidate
            return RunConfig.from_dict(applied(base, changed))
        return parsed.with_keys(changed)
    except ConfigError as exc:
        return exc


def overrides(base: dict, changed: dict) -> list[str]:
    """The train.py overrides a candidate adds to ``base`` (``dist.tp=2``; none for a key it leaves
    at the base's value)."""
    out = []
    for key, value in changed.items():
        group, name = key.split(".")
        if base[group][name] != value:
            out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out
