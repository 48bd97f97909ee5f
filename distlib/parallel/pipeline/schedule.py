"""Pipeline schedules as plain data: one list of actions per pipeline rank, and a checker.

A model of S = P * v stages runs on P pipeline ranks, v chunks per rank. Chunk c of rank r is
global stage ``c * P + r`` (Megatron's interleaving; with v = 1 the stage is the rank). An
``Action`` is a forward ("F") or backward ("B") of one micro-batch through one chunk. The
messages are implied by the stages, never listed:

* after F of stage s < S-1 its output (the activation) goes to stage s+1's rank;
* after B of stage s > 0 its input's gradient goes to stage s-1's rank;
* F of stage s > 0 needs that activation; B needs its own F done and, unless s is the last
  stage, the gradient from stage s+1.

Schedules (m micro-batches):

* ``gpipe``: every forward, then every backward. m activations in flight on every rank.
* ``1f1b``: rank r runs min(P-r-1, m) warm-up forwards, then alternates one forward and one
  backward, then drains the backwards: at most P-r activations in flight (<= P).
* ``interleaved`` (v >= 2, m a multiple of P): Megatron's interleaved 1F1B. Forwards go through
  the chunks in groups of P micro-batches (chunk 0 for micro-batches 0..P-1, chunk 1 for the
  same ones, ..., then the next P); backwards the same with the chunks reversed; rank r warms up
  with 2(P-r-1) + (v-1)P forwards. The bubble shrinks by v: (P-1)/(v*m+P-1).

``check`` runs a plan the way ``executor.run`` does -- sends never block (isend), an action
waits only for the messages it needs, and a rank receives from each peer in the order that peer
sent -- and proves every send has its receive and the plan cannot deadlock. It returns each
rank's peak number of in-flight activations (F done, its B not yet).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" (forward) or "B" (backward)
    micro: int  # micro-batch index, 0..m-1
    chunk: int  # this rank's chunk, 0..v-1 (global stage chunk * P + rank)

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def stage_of(rank: int, chunk: int, P: int) -> int:
    """Global stage of chunk ``chunk`` on pipeline rank ``rank``."""
    return chunk * P + rank


def stage_block_ids(n_layers: int, P: int, v: int, rank: int) -> list[list[int]]:
    """The block indices of each of pipeline rank ``rank``'s ``v`` chunks: ``n_layers / (P v)``
    consecutive blocks per global stage, in stage order."""
    per = n_layers // (P * v)
    return [list(range(stage_of(rank, c, P) * per, (stage_of(rank, c, P) + 1) * per)) for c in range(v)]


def place_of(stage: int, P: int) -> tuple[int, int]:
    """(rank, chunk) that runs global stage ``stage``."""
    return stage % P, stage // P


def validate(name: str, P: int, m: int, v: int = 1) -> None:
    """Raise ValueError (one line naming the problem) for a combination no schedule supports."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    if P < 1 or m < 1 or v < 1:
        raise ValueError(
            f"pipeline needs pp >= 1, micro-batches >= 1 and virtual chunks >= 1, "
            f"got pp={P}, micro-batches={m}, virtual={v}"
        )
    if name != "interleaved" and v != 1:
        raise ValueError(
            f"pipeline schedule {name} runs one chunk per rank: virtual chunks must be 1, got {v} "
            f"(more than one needs the interleaved schedule)"
        )
    if name == "interleaved" and v < 2:
        raise ValueError(
            f"the interleaved pipeline schedule needs at least 2 virtual chunks per rank, got {v}"
        )
    if name == "interleaved" and m % P:
        raise ValueError(
            f"the interleaved pipeline schedule needs the micro-batches (grad_accum={m}) "
            f"to be a multiple of the pipeline degree (pp={P})"
        )


def _gpipe(r: int, P: int, m: int) -> list[Action]:
    return [Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]


def _one_f_one_b(r: int, P: int, m: int) -> list[Action]:
    warmup = min(P - r - 1, m)
    out = [Action("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", i + warmup, 0), Action("B", i, 0)]
    return out + [Action("B", i, 0) for i in range(m - warmup, m)]


def _interleaved(r: int, P: int, m: int, v: int) -> list[Action]:
    def micro(k: int) -> int:
        return (k // (P * v)) * P + k % P

    def forward(k: int) -> Action:
        return Action("F", micro(k), (k // P) % v)

    def backward(k: int) -> Action:
        return Action("B", micro(k), v - 1 - (k // P) % v)

    total = m * v
    warmup = min(2 * (P - r - 1) + (v - 1) * P, total)
    out = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [forward(k + warmup), backward(k)]
    return out + [backward(k) for k in range(total - warmup, total)]


def build(name: str, P: int, m: int, v: int = 1) -> list[list[Action]]:
    """The plan of schedule ``name``: one action list per pipeline rank 0..P-1."""
    validate(name, P, m, v)
    if name == "gpipe":
        return [_gpipe(r, P, m) for r in range(P)]
    if name == "1f1b":
        return [_one_f_one_b(r, P, m) for r in range(P)]
    return [_interleaved(r, P, m, v) for r in range(P)]


def messages_in(action: Action, rank: int, P: int, v: int) -> tuple[str, int, int] | None:
    """The message ``action`` on ``rank`` waits for, as (kind, micro, sending stage), or None.
    "act" is an activation, "grad" a gradient; the key names the stage that sends it."""
    s, last = stage_of(rank, action.chunk, P), P * v - 1
    if action.kind == "F":
        return ("act", action.micro, s - 1) if s > 0 else None
    return ("grad", action.micro, s + 1) if s < last else None


def message_out(action: Action, rank: int, P: int, v: int) -> tuple[str, int, int] | None:
    """The message ``action`` sends when it is done (same key as ``messages_in``), or None."""
    s, last = stage_of(rank, action.chunk, P), P * v - 1
    if action.kind == "F":
        return ("act", action.micro, s) if s < last else None
    return ("grad", action.micro, s) if s > 0 else None


def destination(key: tuple[str, int, int], P: int) -> int:
    """Pipeline rank a message goes to: the next stage for an activation, the previous for a gradient."""
    kind, _, sender = key
    return place_of(sender + 1 if kind == "act" else sender - 1, P)[0]


def check(plan: list[list[Action]], P: int, m: int, v: int = 1) -> list[int]:
    """Simulate ``plan``; raise ValueError if it is malformed, a send has no receive or it
    deadlocks. Returns each rank's peak in-flight activations (forwards whose backward is pending)."""
    if len(plan) != P:
        raise ValueError(f"plan has {len(plan)} ranks, expected pp={P}")
    want = sorted((k, i, c) for k in "FB" for i in range(m) for c in range(v))
    for r, actions in enumerate(plan):
        got = sorted((a.kind, a.micro, a.chunk) for a in actions)
        if got != want:
            raise ValueError(
                f"rank {r}: the plan must run F and B of every (micro-batch, chunk) exactly once"
            )
    sends = [k for r, actions in enumerate(plan) for a in actions if (k := message_out(a, r, P, v))]
    recvs = [k for r, actions in enumerate(plan) for a in actions if (k := messages_in(a, r, P, v))]
    if sorted(sends) != sorted(recvs):
        raise ValueError(
            f"unmatched messages: sent and never received {sorted(set(sends) - set(recvs))}, "
            f"received and never sent {sorted(set(recvs) - set(sends))}"
        )
    sent: set = set()
    done: list[set] = [set() for _ in range(P)]
    pos, live, peak = [0] * P, [0] * P, [0] * P
    while any(pos[r] < len(plan[r]) for r in range(P)):
        progressed = False
        for r in range(P):
            while pos[r] < len(plan[r]):
                a = plan[r][pos[r]]
                need = messages_in(a, r, P, v)
                if (need is not None and need not in sent) or (
                    a.kind == "B" and ("F", a.micro, a.chunk) not in done[r]
                ):
                    break
                done[r].add((a.kind, a.micro, a.chunk))
                if (out := message_out(a, r, P, v)) is not None:
                    sent.add(out)
                live[r] += 1 if a.kind == "F" else -1
                peak[r] = max(peak[r], live[r])
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = "; ".join(
                f"rank {r} at {plan[r][pos[r]]} waits for {messages_in(plan[r][pos[r]], r, P, v)}"
                for r in range(P)
                if pos[r] < len(plan[r])
            )
            raise ValueError(f"pipeline plan deadlocks: {stuck}")
    return peak


def format_plan(plan: list[list[Action]]) -> str:
    """One line per rank, e.g. ``rank 0: F0 F1 B0 F2 B1 B2`` (``F3.1``: micro-batch 3, chunk 1)."""
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in actions) for r, actions in enumerate(plan))
