"""How the planner's dry units add up to a step (``activations``): a chunk's blocks and a
micro-batch's rows extended from the runs of fewer where each one more adds the same (its bytes,
FLOPs, operators and calls), the step's micro-batches repeated, a pipeline rank's sends from its
schedule, and what a step does once where each unit did it (the routing count's share: ``less``).
Every sum is checked against the whole step program it stands for (tests/test_plan_compose.py)."""

from __future__ import annotations

import dataclasses

from distlib.app.plan.timing import Counted, grouped, merged, times
from distlib.parallel.pipeline import schedule


def one_step(counted: list[Counted], runs: int, sent: tuple = ()) -> Counted:
    """The sum of ``counted``, whose ``runs`` unit runs each made the step's loss accumulator
    (a float64 zero) where one step makes one, with ``sent`` added to their calls."""
    return Counted(
        sum(c.flops for c in counted),
        sum(c.ops for c in counted) - (runs - 1),
        sum(c.written for c in counted) - 8 * (runs - 1),
        merged(*(c.calls for c in counted), sent),
    )


def micro_batches(unit: Counted, m: int, grads: int) -> Counted:
    """``m`` micro-batches of ``unit``'s one: every one after the first adds its gradients to the
    parameters' (``grads`` bytes written; the first's are kept as they are, one operator either
    way)."""
    return Counted(unit.flops * m, unit.ops * m, unit.written * m + grads * (m - 1), times(unit.calls, m))


def without_sends(unit: Counted) -> Counted:
    return dataclasses.replace(unit, calls=tuple(c for c in unit.calls if c[0] != "send"))


def send_bytes(units: list[tuple[int, Counted, int]]) -> int:
    """A pipeline message's bytes (activation and gradient alike), as a unit's send noted them."""
    return next(n for _, unit, _ in units for kind, n, _, _ in unit.calls if kind == "send")


def sends(actions: list, rank: int, P: int, v: int, nbytes: int) -> tuple:
    """The sends of pipeline rank ``rank``'s ``actions``: one per message to another rank."""
    out = []
    for a in actions:
        key = schedule.message_out(a, rank, P, v)
        if key is not None and schedule.destination(key, P) != rank:
            out.append(("send", nbytes, P))
    return grouped(out)


def holds(more: tuple, fewer: tuple) -> bool:
    """Whether grouped calls ``more`` make every call of ``fewer`` at least as many times."""
    made = {call[:3]: call[3] for call in more}
    return all(made.get(call[:3], 0) >= call[3] for call in fewer)


def added(a: tuple, b: tuple, more: int) -> tuple:
    """Grouped calls ``a`` with ``more`` times the calls ``b`` adds to them (a block's own)."""
    before = {call[:3]: call[3] for call in a}
    extra = tuple((kind, n, size, more * (t - before.get((kind, n, size), 0))) for kind, n, size, t in b)
    return merged(a, extra)


def stepped(a: tuple, b: tuple, more: int) -> tuple | None:
    """Grouped calls ``a`` and ``more`` times what ``b`` adds to them, call by call in order: one
    made more times (a block's own) or with more bytes (a row's; the experts' balance, one
    all-reduce of every block's counts); None where they differ otherwise (a call made or dropped,
    or grown both ways): not alike."""
    if len(a) != len(b):
        return None
    calls = []
    for (kind, n, size, t), (kind_b, m, size_b, u) in zip(a, b):
        if (kind, size) != (kind_b, size_b) or (n != m and t != u):
            return None
        calls.append((kind, n + more * (m - n), size, t + more * (u - t)))
    return tuple(calls)


def extended(one: tuple, two: tuple, more: int, calls: tuple) -> tuple[int, Counted, int]:
    """``one`` and ``more`` times what ``two`` adds to it, with ``calls`` so extended."""
    a, b = one[1], two[1]
    counted = Counted(
        a.flops + more * (b.flops - a.flops),
        a.ops + more * (b.ops - a.ops),
        a.written + more * (b.written - a.written),
        calls,
    )
    return one[0] + more * (two[0] - one[0]), counted, one[2] + more * (two[2] - one[2])


def less(step: Counted, once: Counted, k: int) -> Counted:
    """``step`` without ``k`` times ``once``: what each of a step's units counted where the step
    does it once (the routing count's all-reduce and the balance it sets)."""
    counts = {call[:3]: call[3] for call in step.calls}
    for kind, n, size, t in once.calls:
        counts[(kind, n, size)] -= k * t  # (a KeyError: a unit without the call, a composition bug)
    return Counted(
        step.flops - k * once.flops,
        step.ops - k * once.ops,
        step.written - k * once.written,
        tuple((*call, t) for call, t in counts.items() if t),
    )
