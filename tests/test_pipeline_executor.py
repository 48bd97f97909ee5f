"""The pipeline executor on real forked gloo ranks: a toy stack of Linear layers split into
stages gives the loss and every gradient of the whole stack run on one rank (torch autograd,
the same micro-batches, each loss / m), for GPipe, 1F1B and interleaved 1F1B at pp 1, 2 and 4 (pp 1:
interleaved chunks hand over on the rank, no message);
the schedules agree with each other; the measured in-flight activations are the plan's, the
measured activation memory follows them, and sent tensors are not held to the end of the step."""

from __future__ import annotations

import pickle

import pytest
import torch
from multiproc import run_ranks
from torch import nn

from distlib.comm.group import Comm
from distlib.comm.p2p import P2P
from distlib.parallel.pipeline import executor, schedule
from distlib.parallel.pipeline.recorder import Recorder

D, B = 8, 3
CASES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("mixed", 1))


def plan_of(name: str, P: int, m: int, v: int):
    """The schedule's plan; "mixed" is GPipe with the backwards reversed on even ranks, so a rank
    consumes its gradients in another order than its neighbour sends them: the executor must
    receive in the sender's order (one FIFO per peer) to hand each backward its own gradient."""
    if name != "mixed":
        return schedule.build(name, P, m, v)
    plan = schedule.build("gpipe", P, m)
    return [acts[:m] + (acts[m:][::-1] if r % 2 == 0 else acts[m:]) for r, acts in enumerate(plan)]


def stack(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)) for _ in range(num_stages)]


def batch(m: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(m, B, D, generator=g), torch.randn(m, B, D, generator=g)


def loss_of(out, target):
    return ((out - target) ** 2).mean()


def reference(num_stages: int, m: int):
    """The whole stack on one rank: loss sum_i loss_i / m, gradients accumulated per micro-batch."""
    stages, (xs, ts) = stack(num_stages), batch(m)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(m):
        h = xs[i]
        for s in stages:
            h = s(h)
        loss = loss_of(h, ts[i]) / m
        loss.backward()
        total += loss.detach().double()
    return total, [[p.grad.clone() for p in s.parameters()] for s in stages]


def _pipeline(comm, m, transport="plain"):
    torch.set_num_threads(1)
    if (
        transport == "batched"
    ):  # NCCL's way: posted together at the first wait (a forked rank: patched here only)
        Comm.batched = property(lambda self: True)
    if transport == "staged":  # a CUDA tensor over gloo: every message through a separate buffer
        P2P.staged = lambda self, t: True
    P, out = comm.size, {}
    xs, ts = batch(m)
    for name, v in CASES:
        stages = stack(P * v)
        chunks = [stages[schedule.stage_of(comm.rank, c, P)] for c in range(v)]
        plan = plan_of(name, P, m, v)
        rec = Recorder(comm.rank)
        loss = executor.run(
            plan,
            chunks,
            comm,
            feed=lambda i: xs[i],
            loss_fn=lambda i, y: loss_of(y, ts[i]),
            act_shape=(B, D),
            act_dtype=torch.float32,
            device="cpu",
            recorder=rec,
        )
        grads = {
            schedule.stage_of(comm.rank, c, P): [p.grad.clone() for p in chunks[c].parameters()]
            for c in range(v)
        }
        out[name] = dict(
            loss=loss,
            grads=grads,
            peak=rec.peak_in_flight,
            events=len(rec.events),
            peak_bytes=rec.peak_bytes,
            live_bytes=rec.live_bytes,
            peak_sends=rec.peak_sends,
        )
    return pickle.dumps(out)  # plain pickle: a queue would share the tensors' memory with a rank that exits


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("P", [1, 2, 4])
def test_pipeline_matches_one_rank(P):
    check_against_one_rank(P, "plain")


@pytest.mark.parametrize("transport", ["batched", "staged"])
def test_pipeline_over_the_gpu_transports(transport):
    """The message paths a GPU takes, exercised over gloo (tests/test_devices.py does the same for
    the collectives): NCCL's batched posting (sends wait for the rank's next wait: no deadlock)
    and staging through buffers."""
    check_against_one_rank(2, transport)


def check_against_one_rank(P: int, transport: str) -> None:
    m = 8
    results = [pickle.loads(r) for r in run_ranks(_pipeline, P, m, transport)]
    for name, v in CASES:
        plan = plan_of(name, P, m, v)
        print(f"\n{name} pp={P} m={m} v={v}\n{schedule.format_plan(plan)}")
        ref_loss, ref_grads = reference(P * v, m)
        last_rank = schedule.place_of(P * v - 1, P)[0]
        losses = [r[name]["loss"] for r in results]
        assert rel(losses[last_rank], ref_loss) < 1e-6, (name, losses[last_rank], ref_loss)
        assert all(loss.item() == 0 for r, loss in enumerate(losses) if r != last_rank)
        for r in range(P):
            for s, gs in results[r][name]["grads"].items():
                for g, ref in zip(gs, ref_grads[s]):
                    assert rel(g, ref) < 1e-6, (name, r, s)
        # measured in flight == what the checker predicts from the plan
        assert [r[name]["peak"] for r in results] == schedule.check(plan, P, m, v)
        assert all(r[name]["events"] == 2 * m * v for r in results)
    for r, res in enumerate(results):
        # activation memory follows the in-flight micro-batches (each holds the same bytes on a stage)
        assert res["gpipe"]["peak_bytes"] * min(P - r, m) == res["1f1b"]["peak_bytes"] * m > 0
        assert all(res[name]["live_bytes"] == 0 for name, _ in CASES)
        # sent tensors are let go once a reply shows they arrived: 1F1B holds as few as it has in flight
        assert res["1f1b"]["peak_sends"] <= P, res["1f1b"]["peak_sends"]
    for r in range(P):  # gpipe and 1f1b run the same stages: the same gradients
        for s in results[r]["gpipe"]["grads"]:
            for g1, g2 in zip(results[r]["gpipe"]["grads"][s], results[r]["1f1b"]["grads"][s]):
                assert rel(g1, g2) < 1e-6


def test_the_recorder_keeps_what_the_backward_needs_not_what_a_dropped_branch_saved():
    x = torch.randn(4, 8, requires_grad=True)
    lin = nn.Linear(8, 8)
    rec = Recorder(0)
    held: list = []
    with rec.forward(0, 0, lin, held):
        unused = x.exp()  # saves its output; nothing uses it, so its graph (and what it saved) goes
        del unused
        y = lin(x)  # saves x (the weight is the chunk's own: not counted)
        held += [y]  # the chunk's output, held to its backward
    assert rec.live_bytes == rec.peak_bytes == x.nbytes + y.nbytes
    y.sum().backward()
    rec.backward_done(0, 0)
    assert rec.live_bytes == 0
