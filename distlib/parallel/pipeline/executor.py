"""Run one pipeline rank's schedule over point-to-point messages.

Interface::

    loss = run(plan, chunks, comm, feed=..., loss_fn=..., act_shape=..., act_dtype=..., device=...,
               recorder=None, inputs=None)

* ``plan``: the whole plan, ``schedule.build(...)`` (every rank's list: a rank receives from a
  peer in the order that peer sends, which it reads from the peer's list). This rank runs
  ``plan[comm.rank]``.
* ``chunks``: this rank's v modules; ``chunks[c]`` is global stage ``c * P + comm.rank``
  (P = ``comm.size``). A chunk maps hidden states to hidden states; the first stage's chunk
  takes ``feed(micro)`` (token ids) instead, the last stage's output goes to ``loss_fn``.
* ``comm``: the pipeline group (``Comm``), pipeline rank = group rank. Messages go through
  ``P2P`` ("pipeline"), so a dead or timed-out peer raises ``CollectiveError`` naming both ranks.
* ``feed(micro) -> Tensor``: the first stage's input of micro-batch ``micro`` (called on the
  rank of stage 0 only). ``loss_fn(micro, output) -> scalar``: the last stage's loss of that
  micro-batch (called on the rank of the last stage only).
* ``act_shape`` / ``act_dtype``: every activation passed between stages (and its gradient) has
  this shape and dtype; receive buffers are made on ``device``.
* ``recorder``: a ``recorder.Recorder`` that gets the timed events and activation memory.
* ``inputs(micro) -> tuple``: what every chunk's forward takes for micro-batch ``micro`` after
  its input (e.g. where its tokens sit in their sequences, and its dropout masks' keys); None:
  nothing more.

Each micro-batch's loss is divided by m (the micro-batches in the plan) before its backward, as
the trainer does for gradient accumulation, so the accumulated gradients are the full batch's
mean. Returns the sum of those divided losses as a float64 scalar on ``device`` on the rank of
the last stage (added in micro-batch order, like the trainer's loop), zero on the others: a
sum over the pipeline group gives everyone the loss.

A forward keeps its input (made ``requires_grad``) and output until its backward, which calls
``torch.autograd.backward(output, grad)`` and sends ``input.grad`` upstream. Sends are posted
(isend) and never block: each is waited on once a later message back from its peer shows that
it was received (the wait returns at once and its tensor is let go: ``confirmations``), the rest
at the end of the step; a receive is posted when
its action needs it (with any earlier messages from the same peer, in the peer's send order) --
the semantics ``schedule.check`` proves deadlock-free. Two stages on the same rank (interleaved,
P = 1) hand the tensor over without a message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor, nn

from distlib.comm.group import Comm
from distlib.comm.p2p import P2P
from distlib.parallel.pipeline import schedule
from distlib.parallel.pipeline.schedule import Action


class _Mailbox:
    """Incoming messages: per peer, the keys it sends us in its order; receives posted lazily."""

    def __init__(self, plan: list[list[Action]], me: int, P: int, v: int, p2p: P2P, shape, dtype, device):
        self.p2p, self.shape, self.dtype, self.device = p2p, shape, dtype, device
        self.order: dict[int, list] = {}
        for peer, actions in enumerate(plan):
            for a in actions:
                key = schedule.message_out(a, peer, P, v)
                if key is not None and schedule.destination(key, P) == me:
                    self.order.setdefault(peer, []).append(key)
        self.next = dict.fromkeys(self.order, 0)
        self.posted: dict = {}  # key -> (buffer, handle)
        self.local: dict = {}  # key -> tensor handed over on the same rank

    def put_local(self, key, tensor: Tensor) -> None:
        self.local[key] = tensor

    def get(self, key, peer: int) -> Tensor:
        if key in self.local:
            return self.local.pop(key)
        while key not in self.posted:
            k = self.order[peer][self.next[peer]]
            self.next[peer] += 1
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.posted[k] = (buf, self.p2p.recv(buf, peer))
        buf, handle = self.posted.pop(key)
        self.p2p.wait(handle)
        return buf


def confirmations(plan: list[list[Action]], me: int, P: int, v: int) -> dict:
    """For each message this rank sends to another rank: the first message that rank sends back
    after the action that consumed it (key -> key). Once that reply arrived, the send is complete
    and its wait returns at once, so its tensor can be let go; a send with no reply waits at the
    end of the step. (gloo's send work reports completion only from its wait.)"""
    out = {}
    for a in plan[me]:
        key = schedule.message_out(a, me, P, v)
        if key is None or (to := schedule.destination(key, P)) == me:
            continue
        acts = plan[to]
        used = next(i for i, b in enumerate(acts) if schedule.messages_in(b, to, P, v) == key)
        for b in acts[used + 1 :]:
            reply = schedule.message_out(b, to, P, v)
            if reply is not None and schedule.destination(reply, P) == me:
                out[key] = reply
                break
    return out


def run(
    plan: list[list[Action]],
    chunks: list[nn.Module],
    comm: Comm,
    *,
    feed: Callable[[int], Tensor],
    loss_fn: Callable[[int, Tensor], Tensor],
    act_shape,
    act_dtype: torch.dtype,
    device,
    recorder=None,
    inputs: Callable[[int], tuple] | None = None,
) -> Tensor:
    """Run ``plan[comm.rank]`` (see the module docstring); returns this rank's summed loss / m."""
    P, me, v = comm.size, comm.rank, len(chunks)
    actions = plan[me]
    m = len(actions) // (2 * v)
    last = P * v - 1
    p2p = P2P("pipeline", comm)
    mail = _Mailbox(plan, me, P, v, p2p, act_shape, act_dtype, device)
    sends: dict = {}  # key -> (handle, tensor): the tensor is kept alive until the wait
    release: dict = {}  # reply key -> the sends it confirms
    for key, reply in confirmations(plan, me, P, v).items():
        release.setdefault(reply, []).append(key)
    kept: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
    total = torch.zeros((), dtype=torch.float64, device=device)
    clock = recorder.clock if recorder is not None else None

    def deliver(key, tensor: Tensor) -> None:
        to = schedule.destination(key, P)
        if to == me:
            mail.put_local(key, tensor)
        else:
            sends[key] = (p2p.send(tensor, to), tensor)
            if recorder is not None:
                recorder.pending_sends(len(sends))

    for a in actions:
        s = schedule.stage_of(me, a.chunk, P)
        need = schedule.messages_in(a, me, P, v)
        received = mail.get(need, schedule.place_of(need[2], P)[0]) if need is not None else None
        if need in release:
            p2p.wait(*(sends.pop(k)[0] for k in release.pop(need) if k in sends))
        t0 = clock() if clock else 0.0
        if a.kind == "F":
            x = feed(a.micro) if s == 0 else received.requires_grad_(x_needs_grad(received))
            held: list = []
            ctx = (
                recorder.forward(a.micro, a.chunk, chunks[a.chunk], held)
                if recorder
                else contextlib.nullcontext()
            )
            with ctx:
                y = chunks[a.chunk](x, *(inputs(a.micro) if inputs else ()))
                if s == last:
                    y = loss_fn(a.micro, y) / m
                    total += y.detach().to(torch.float64)
                held += [x, y]
            kept[(a.micro, a.chunk)] = (x, y)
            out = schedule.message_out(a, me, P, v)
            if out is not None:
                deliver(out, y.detach().contiguous())
        else:
            x, y = kept.pop((a.micro, a.chunk))
            torch.autograd.backward(y, None if s == last else received)
            out = schedule.message_out(a, me, P, v)
            if out is not None:
                deliver(out, x.grad)
            del x, y
            if recorder is not None:
                recorder.backward_done(a.micro, a.chunk)
        if recorder is not None:
            recorder.event(a.kind, a.micro, a.chunk, t0, clock())
    p2p.wait(*(h for h, _ in sends.values()))
    return total


def x_needs_grad(t: Tensor) -> bool:
    """A received activation carries a gradient back only if it is floating point."""
    return t.is_floating_point()


def forward_only(
    plan: list[list[Action]],
    chunks: list[nn.Module],
    comm: Comm,
    *,
    feed: Callable[[int], Tensor],
    act_shape,
    act_dtype: torch.dtype,
    device,
    inputs: Callable[[int], tuple] | None = None,
) -> None:
    """Every forward of ``plan[comm.rank]``, in its order, without a graph or a loss (arguments as
    ``run``'s): what a model's modules see of the step's forwards before it runs. The forward
    actions of a plan, taken alone, are still deadlock-free: each waits only for its input, which
    an earlier forward of the same (acyclic) order sends, and sends never block."""
    P, me, v = comm.size, comm.rank, len(chunks)
    forwards = [[a for a in actions if a.kind == "F"] for actions in plan]
    p2p = P2P("pipeline", comm)
    mail = _Mailbox(forwards, me, P, v, p2p, act_shape, act_dtype, device)
    sends = []
    with torch.no_grad():
        for a in forwards[me]:
            need = schedule.messages_in(a, me, P, v)
            x = feed(a.micro) if need is None else mail.get(need, schedule.place_of(need[2], P)[0])
            y = chunks[a.chunk](x, *(inputs(a.micro) if inputs else ()))
            out = schedule.message_out(a, me, P, v)
            if out is None:
                continue
            if (to := schedule.destination(out, P)) == me:
                mail.put_local(out, y)
            else:
                sends.append((p2p.send(y.contiguous(), to), y))
    p2p.wait(*(h for h, _ in sends))
