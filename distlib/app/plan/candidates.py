"""The layouts a model can run in over a world size: every combination of the dimensions and the
ZeRO options that decide what each rank holds, kept where the configuration accepts it.

Searched (each unless the command line sets it): dist.tp, dist.pp, dist.cp and, for a model with
experts, dist.ep, over the divisors of the world size; the pipeline's schedule (1f1b, gpipe,
interleaved with 2 chunks per rank); zero.stage 0-3 and zero.overlap. Everything else (the batch,
the dtype, bucket sizes, the model) is the command line's. A candidate the configuration refuses
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
SEARCHED = ("dist.tp", "dist.pp", "dist.cp", "dist.ep", "dist.pp_schedule", "dist.pp_virtual")
SEARCHED += ("zero.stage", "zero.overlap")


def pinned(overrides: list[str]) -> set[str]:
    """The searched keys a command line fixes: each it names (``dist.tp=2``), and every one of a
    group it chooses a file of (``zero=stage3`` fixes zero.stage and zero.overlap)."""
    named = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    return {key for key in SEARCHED if key in named or key.split(".")[0] in named}


def candidates(base: dict, fixed: set[str]) -> Iterator[tuple[dict, RunConfig | ConfigError]]:
    """Each candidate's changed keys ({"dist.tp": 2, ...}) with its checked configuration, or the
    ConfigError refusing it; ``fixed``: the dotted keys the command line set (``pinned``)."""
    world = base["dist"]["world_size"]
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    experts = base["model"]["family"] in EXPERT_FAMILIES  # (the tree is checked per candidate)

    def choices(key: str, values) -> list[dict]:
        return [{}] if key in fixed else [{key: v} for v in values]

    dims = [
        choices("dist.tp", divisors),
        choices("dist.pp", divisors),
        choices("dist.cp", divisors),
        choices("dist.ep", divisors if experts else [1]),
        choices("zero.stage", (0, 1, 2, 3)),
        choices("zero.overlap", (False, True)),
    ]
    for picked in itertools.product(*dims):
        keys = {k: v for part in picked for k, v in part.items()}
        degree = {d: keys.get(f"dist.{d}", base["dist"][d]) for d in ("tp", "pp", "cp")}
        if world % (degree["tp"] * degree["pp"] * degree["cp"]):
            continue  # not a grid of this world (no need to ask the configuration)
        pp = degree["pp"]
        schedules = [{}] if pp == 1 or "dist.pp_schedule" in fixed else PIPELINE
        for schedule in schedules:
            changed = keys | {f"dist.{k}": v for k, v in schedule.items()}
            yield changed, _checked(base, changed)


def applied(base: dict, changed: dict) -> dict:
    """A copy of the tree ``base`` with a candidate's ``changed`` keys set."""
    tree = copy.deepcopy(base)
    for key, value in changed.items():
        group, name = key.split(".")
        tree.setdefault(group, {})[name] = value
    return tree


def _checked(base: dict, changed: dict) -> RunConfig | ConfigError:
    try:
        return RunConfig.from_dict(applied(base, changed))
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
