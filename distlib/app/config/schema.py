"""How a configuration key is declared, and the one check every key goes through.

A config group is a frozen dataclass deriving from ``Group``. Each key is declared once: its type
(the field's annotation), its default and allowed values (``key(default, ge=/gt=/le=/lt=,
choices=)``), and its meaning, a ``name: text`` line of the class docstring (continuation lines
indented). ``Group.__post_init__`` checks every field against its type and rule, so a group cannot
be built from a bad value, however it is built (from Hydra's tree, from a checkpoint manifest, in
a test). Hydra's defaults, the reference in docs/config.md and every error message come from these
declarations; nothing repeats them.

Types: ``int`` (not a bool), ``float`` (an int is accepted and stored as a float; non-finite values
are refused), ``bool``, ``str``, ``tuple[int, int]`` (a list of that many) and ``tuple[T, ...]`` (a list
of any length of one of the first four, each element under the key's bounds), each optionally
``| None``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A configuration value that cannot work, with the key that holds it."""


@dataclass(frozen=True)
class Rule:
    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None


def key(default: Any, *, ge=None, gt=None, le=None, lt=None, choices=None) -> Any:
    """A config field: its default and the values it may take (its meaning: the class docstring)."""
    rule = Rule("", ge, gt, le, lt, tuple(choices) if choices is not None else None)
    return field(default=default, metadata={"rule": rule})


@dataclass(frozen=True)
class Spec:
    """One key as the checks and the reference see it."""

    name: str
    type: Any
    default: Any
    rule: Rule

    @property
    def optional(self) -> bool:
        return _nullable(self.type)

    @property
    def base(self) -> Any:
        return _base(self.type)


def _nullable(tp) -> bool:
    return isinstance(tp, types.UnionType) and type(None) in tp.__args__


def _base(tp):
    if isinstance(tp, types.UnionType):
        rest = [a for a in tp.__args__ if a is not type(None)]
        return rest[0]
    return tp


def helps(cls) -> dict[str, str]:
    """Each key's meaning from the group's docstring: ``name: text`` lines, continuations indented."""
    found: dict[str, str] = {}
    name = None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        entry = re.match(r"(\w+): (.*)", line)
        if entry:
            name, found[entry[1]] = entry[1], entry[2].strip()
        elif line.startswith(" ") and name:
            found[name] += " " + line.strip()
        else:
            name = None
    return found


# once per class: every group's construction asks it, and reading the type hints compiles each
# annotation (measured on a 2-core EPYC: a whole RunConfig.from_dict took 14 ms, and 0.6 ms once
# cached; issue 41's planner checks thousands of layouts)
@functools.cache
def specs(cls) -> tuple[Spec, ...]:
    """The keys of a group, in declaration order; a key its docstring does not explain is an error."""
    hints, meaning = typing.get_type_hints(cls), helps(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "rule" not in f.metadata:
            continue
        if f.name not in meaning:
            raise TypeError(f"{cls.__name__}.{f.name}: add a '{f.name}: <meaning>' line to its docstring")
        out.append(
            Spec(
                f.name,
                hints[f.name],
                f.default,
                dataclasses.replace(f.metadata["rule"], help=meaning[f.name]),
            )
        )
    return tuple(out)


def describe(spec: Spec) -> str:
    """What a key accepts, in words: "an integer >= 1", "one of ['a', 'b']", "null or a number > 0"."""
    rule, base = spec.rule, spec.base
    if rule.choices is not None:
        what = f"one of {list(rule.choices)}"
    elif base is bool:
        what = "true or false"
    elif base is int or base is float:
        what = ("an integer" if base is int else "a number") + _bounds(rule)
    elif base is str:
        what = "a string"
    elif _element(base) is not None:
        what = f"a list of {_WORDS[_element(base)]}s" + _bounds(rule, " each")
    else:
        what = f"a list of {len(typing.get_args(base))} integers"
    return f"null or {what}" if spec.optional else what


_WORDS = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _bounds(rule: Rule, lead: str = "") -> str:
    """ " >= 1 and < 2" (after ``lead``), or "" without bounds."""
    bounds = [
        f"{op} {_num(v)}"
        for op, v in ((">=", rule.ge), (">", rule.gt), ("<=", rule.le), ("<", rule.lt))
        if v is not None
    ]
    return f"{lead} " + " and ".join(bounds) if bounds else ""


def _element(base) -> type | None:
    """T of a ``tuple[T, ...]`` (a list of any length), else None."""
    args = typing.get_args(base)
    return args[0] if len(args) == 2 and args[1] is Ellipsis else None


def _num(v: float) -> str:
    return f"{v:g}"


def _type_ok(value, base) -> bool:
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if base is str:
        return isinstance(value, str)
    if _element(base) is not None:  # tuple[T, ...]
        return isinstance(value, (list, tuple)) and all(_type_ok(v, _element(base)) for v in value)
    args = typing.get_args(base)  # tuple[int, int]
    return (
        isinstance(value, (list, tuple))
        and len(value) == len(args)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def _in_range(value, rule: Rule) -> bool:
    if rule.choices is not None:
        return value in rule.choices and type(value) in {type(c) for c in rule.choices}
    return (
        (rule.ge is None or value >= rule.ge)
        and (rule.gt is None or value > rule.gt)
        and (rule.le is None or value <= rule.le)
        and (rule.lt is None or value < rule.lt)
    )


def check_value(group: str, spec: Spec, value):
    """``value`` as the key stores it (an int as a float for a float key, a list as a tuple), or a
    ConfigError naming the key, what it accepts and what it got."""
    name = f"{group}.{spec.name}" if group else spec.name
    if value is None and spec.optional:
        return None
    base = spec.base
    if (
        value is None
        or not _type_ok(value, base)
        or (base in (int, float, str) and not _in_range(value, spec.rule))
        or (_element(base) is not None and not all(_in_range(v, spec.rule) for v in value))
    ):
        raise ConfigError(f"{name} must be {describe(spec)}, got {value!r}")
    if base is float:
        return float(value)
    if _element(base) is float:
        return tuple(float(v) for v in value)
    if base not in (int, bool, str):
        return tuple(value)
    return value


class Group:
    """A config group's dataclass base: builds from a dict, checks every key on construction."""

    GROUP: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for spec in specs(type(self)):
            object.__setattr__(self, spec.name, check_value(self.GROUP, spec, getattr(self, spec.name)))
        self.check()

    def check(self) -> None:
        """Rules between the group's own keys (subclasses raise ConfigError naming them)."""

    @classmethod
    def from_dict(cls, values: dict | None):
        """The group from a plain dict (what Hydra composed, or a manifest's copy): unknown keys are
        refused by name, missing ones take their defaults."""
        values = dict(values or {})
        known = [s.name for s in specs(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            where = f"config group '{cls.GROUP}'" if cls.GROUP else "the top level"
            raise ConfigError(f"unknown key(s) in {where}: {unknown} (known: {sorted(known)})")
        return cls(**values)

    def to_dict(self) -> dict:
        """Every key with its value (tuples as lists: what JSON and Hydra hold)."""
        return {
            s.name: list(v) if isinstance(v := getattr(self, s.name), tuple) else v for s in specs(type(self))
        }


def defaults(cls) -> dict:
    """The group's keys with their defaults (Hydra's defaults tree, the reference's column)."""
    return {s.name: list(s.default) if isinstance(s.default, tuple) else s.default for s in specs(cls)}
