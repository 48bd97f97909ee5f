"""ZeRO-3's units: the model's top-level children whose parameters are gathered together, and the
later modules that use an earlier unit's parameters (a tied LM head). ``stage3`` gathers by them;
``predict`` counts them."""

from __future__ import annotations

from collections.abc import Collection

import torch.nn as nn


def unit_members(
    model: nn.Module, params: Collection[nn.Parameter] | None = None
) -> list[tuple[nn.Module, int | None]]:
    """The model's top-level children that hold parameters (of ``params``, if given: a parameter
    group's) (ModuleLists and ModuleDicts expanded), in order, each with None when it is a unit, or
    else the index of the earlier unit all of whose parameters it uses (a tied LM head uses the
    token embedding's unit)."""
    ours = None if params is None else {id(p) for p in params}

    def held(m: nn.Module) -> list[nn.Parameter]:
        return [p for p in m.parameters() if ours is None or id(p) in ours]

    if any(True for _ in model.parameters(recurse=False)):
        raise ValueError(
            f"ZeRO-3 needs every parameter inside a child module; {type(model).__name__} holds some directly"
        )
    members = []
    for child in model.children():
        group = child.values() if isinstance(child, nn.ModuleDict) else child
        members += (
            list(group) if isinstance(child, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) else [child]
        )
    out, unit_of, count = [], {}, 0
    for m in members:
        owners = {unit_of.get(id(p)) for p in held(m)}
        if not owners:
            continue
        if owners == {None}:
            unit_of.update({id(p): count for p in held(m)})
            out.append((m, None))
            count += 1
        elif len(owners) == 1:
            out.append((m, owners.pop()))
        else:
            raise ValueError(
                f"ZeRO-3: a {type(m).__name__} holds parameters of several units (or its own and an earlier "
                f"unit's); only a whole module's parameters can be shared"
            )
    return out


def unit_modules(model: nn.Module) -> list[nn.Module]:
    """The units: the top-level children (ModuleLists and ModuleDicts expanded) holding parameters
    of their own."""
    return [m for m, owner in unit_members(model) if owner is None]
