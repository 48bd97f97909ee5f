"""Expert parallelism (distlib/parallel/expert_parallel.py, ``moe.MoE.hold_experts_``): a Mixtral
whose experts split over an expert group, tokens dispatched to their experts' ranks and back by
the all-to-all with uneven splits, trains what one rank trains.

On gloo ranks, the model, its data and ZeRO over two parameter groups (dense over the batch ranks;
experts over the ranks holding the same experts, their gradient scaled by 1/ep): 20 steps at
ep = 2 (world 2) and ep = 1, 2, 4 over 4 data-parallel ranks, ZeRO 0, 1 and 3, each step's loss
(the batch's mean over ranks), aux loss and grad norm within 1e-5 of one rank's and the tokens
per expert identical; each rank holds only its experts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from multiproc import run_ranks
from trainrun import starving_router

from distlib.app.config.groups import OptimizerConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.data.batches import BatchPlan, GlobalBatches, make_corpus
from distlib.app.model import families
from distlib.comm import collectives
from distlib.comm.layout import Layout
from distlib.comm.mesh import build_mesh
from distlib.parallel.expert_parallel import Routing, expert_grad_scale, held_experts
from distlib.parallel.zero import ParamGroup, ZeroOptimizer, make_optimizer

TOL = 1e-5
STEPS = 20
BATCH = 8  # samples per step over every data-parallel rank
MOE = ModelConfig(
    family="mixtral",
    vocab_size=64,
    seq_len=16,
    dim=32,
    n_heads=4,
    n_kv_heads=2,
    n_layers=2,
    mlp_hidden=40,
    n_experts=4,
    router_aux_loss_coef=0.02,
)
ADAMW = OptimizerConfig(lr=3e-3).adamw
CLIP = 1.0


def _optimizer(model, mesh, ep: int, stage: int):
    if ep == 1:
        return make_optimizer(model, mesh.batch, stage, ADAMW, CLIP)
    experts = families.hold_experts_(model, mesh.ep)
    dense = tuple(n for n, _ in model.named_parameters() if n not in experts)
    groups = [
        ParamGroup("dense", dense, mesh.batch),
        ParamGroup("experts", experts, mesh.expert_dp, (mesh.ep,), expert_grad_scale(mesh.ep)),
    ]
    return ZeroOptimizer(model, groups, stage, ADAMW, CLIP)


# A router forced to starve experts (issue #37: an expert rank that receives no token must still
# get its own tokens' outputs back). Step -> {global sample (None: every sample): the experts its
# tokens may not choose}. Over 4 batch ranks rank r holds samples 2r and 2r + 1.
STARVED = {
    2: {None: {2, 3}},  # no token anywhere for the last two experts: ep 2's rank 1 and ep 4's ranks 2, 3
    3: {None: {2, 3}},
    5: {None: {1}},  # expert 1 alone: ep 4's rank 1 receives nothing
    6: {None: {1}},
    8: {0: {0}, 1: {0}},  # expert 0 gets no token from rank 0's samples only (the others' it does)
    9: {2: {2, 3}, 3: {2, 3}},  # rank 1's tokens go to experts 0 and 1 only: nothing to ep 2's rank 1
}


def _force_router_(model, first_sample: int, clock: list[int]) -> None:
    """Every block's router starved as ``STARVED`` says at step ``clock[0]``."""
    mask = starving_router(STARVED, lambda: clock[0], first_sample, MOE.seq_len)
    for block in model.blocks:
        block.mlp.gate.register_forward_hook(mask)


def _train(comm, ep: int, stage: int, capacity: float | None = None, starve: bool = False):
    mesh = build_mesh(comm, Layout.of(comm.size, ep=ep))
    model = families.build(replace(MOE, capacity_factor=capacity), seed=5)  # the same on every rank
    families.join_batch_(model, mesh.batch)
    opt = _optimizer(model, mesh, ep, stage)
    held = sorted({int(n.split(".")[4]) for n, _ in model.named_parameters() if ".experts." in n})
    data = GlobalBatches(
        make_corpus(1, 8192, MOE.vocab_size), MOE.seq_len, BatchPlan(BATCH, mesh.dp.size, 1), seed=3
    )
    clock = [0]
    if starve:
        _force_router_(model, mesh.dp.rank * (BATCH // mesh.dp.size), clock)
    losses, aux, norms, tokens = [], [], [], []
    for step in range(STEPS):
        clock[0] = step
        ((x, y),) = data.micro_batches(step, mesh.dp.rank)
        loss = model(x, y)
        loss.backward()
        norms.append(opt.step())
        opt.zero_grad()
        mean = collectives.all_reduce(loss.detach().clone(), mesh.batch, op="sum") / mesh.batch.size
        losses.append(float(mean))
        fields = model.step_fields(1)
        aux.append(fields["aux_loss"])
        tokens.append([fields["expert_tokens"], fields.get("dropped_tokens")])
    return held, losses, aux, norms, tokens


@pytest.fixture(scope="module")
def one_rank():
    return run_ranks(_train, 1, 1, 0)[0]


def test_an_expert_capacity_drops_the_same_assignments_at_every_ep():
    """(``model.capacity_factor``: the drops are decided on the token's rank, per sequence.)"""
    _, ref_losses, _, _, ref_tokens = run_ranks(_train, 1, 1, 0, 0.75)[0]
    assert sum(sum(dropped) for _, dropped in ref_tokens) > 0
    for world, ep in [(2, 2), (4, 4)]:
        for rank, (_, losses, _, _, tokens) in enumerate(run_ranks(_train, world, ep, 0, 0.75)):
            assert tokens == ref_tokens, (world, ep, rank)
            assert losses == pytest.approx(ref_losses, abs=TOL, rel=0), (world, ep, rank)


@pytest.mark.parametrize(
    "world, ep, stage",
    [(2, 2, 0), (4, 1, 0), (4, 2, 1), (4, 4, 3)],
    ids=["ep2", "dp4", "dp4-ep2-z1", "dp4-ep4-z3"],
)
def test_every_expert_layout_trains_to_one_ranks_losses(one_rank, world, ep, stage):
    _, ref_losses, ref_aux, ref_norms, ref_tokens = one_rank
    assert ref_losses[-1] < ref_losses[0] - 0.1, "the reference must learn for the comparison to mean much"
    assert len({str(t) for t in ref_tokens}) > 1, "the routing must change over the run"
    for rank, (held, losses, aux, norms, tokens) in enumerate(run_ranks(_train, world, ep, stage)):
        assert held == list(held_experts(MOE.n_experts, ep, rank % ep)), rank
        assert losses == pytest.approx(ref_losses, abs=TOL, rel=0), rank
        assert aux == pytest.approx(ref_aux, abs=TOL, rel=0), rank
        assert norms == pytest.approx(ref_norms, abs=TOL, rel=0), rank
        assert tokens == ref_tokens, rank


def test_routing_splits_by_the_ranks_holding_the_experts():
    # 2 ranks, 4 experts: rank 0 holds 0-1, rank 1 holds 2-3
    table = [[3, 0, 2, 5], [1, 4, 0, 2]]
    first, second = Routing(table, 0), Routing(table, 1)
    assert first.send() == [3, 7] and first.recv() == [3, 5]
    assert second.send() == [5, 2] and second.recv() == [7, 2]


def test_experts_that_do_not_split_over_the_ranks_are_refused():
    with pytest.raises(ValueError, match="6 experts do not split over 4 expert-parallel ranks"):
        held_experts(6, 4, 0)


def _exchange_gradients(comm):
    """Every expert on every rank (ep = 1) vs half of them on each of 2 ranks: the same outputs and
    input gradients for each rank's own rows; the expert gradients summed over the two ranks."""
    mesh = build_mesh(comm, Layout.of(comm.size, ep=2))
    whole = families.build(MOE, seed=5).blocks[0].mlp
    split = families.build(MOE, seed=5).blocks[0].mlp
    split.hold_experts_(mesh.ep)
    x = torch.randn(2, 12, MOE.dim, generator=torch.Generator().manual_seed(comm.rank))
    outs, grads = [], []
    for moe in (whole, split):
        xi = x.clone().requires_grad_()
        out = moe(xi)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        outs.append(out.detach())
        grads.append(xi.grad)
    every = torch.stack([e.w2.weight.grad for e in whole.experts])  # each rank's rows' gradients
    collectives.all_reduce(every, comm, op="sum")
    total = every[2 * comm.rank]  # an expert this rank holds
    held = split.experts[str(2 * comm.rank)].w2.weight.grad
    return (
        float((outs[0] - outs[1]).abs().max()),
        float((grads[0] - grads[1]).abs().max()),
        float((total - held).abs().max()),
        sorted(split.experts.keys()),
    )


def test_dispatch_and_combine_carry_rows_and_gradients_both_ways():
    for rank, (out, grad, expert, keys) in enumerate(run_ranks(_exchange_gradients, 2)):
        assert out < 1e-6 and grad < 1e-6 and expert < 1e-6, (rank, out, grad, expert)
        assert keys == [str(2 * rank), str(2 * rank + 1)]


def _starved(tokens: list, step: int) -> set[int]:
    """The experts no token of ``step`` reached, in every block."""
    counts, _ = tokens[step]
    return {e for e in range(MOE.n_experts) if all(block[e] == 0 for block in counts)}


@pytest.fixture(scope="module")
def starved_one_rank():
    return {cap: run_ranks(_train, 1, 1, 0, cap, True)[0] for cap in (None, 0.75)}


def test_the_forced_router_starves_the_experts_it_names(starved_one_rank):
    for cap, (_, _, _, _, tokens) in starved_one_rank.items():
        for step, rule in STARVED.items():
            if None in rule:
                assert _starved(tokens, step) == rule[None], (cap, step)
        assert all(_starved(tokens, step) == set() for step in range(STEPS) if step not in STARVED), cap


@pytest.mark.parametrize(
    "ep, stage, capacity",
    [(2, 0, None), (4, 3, None), (2, 3, 0.75), (4, 0, 0.75)],
    ids=["ep2-z0", "ep4-z3", "ep2-z3-capacity", "ep4-z0-capacity"],
)
def test_starved_experts_train_to_one_ranks_losses(starved_one_rank, ep, stage, capacity):
    """(Each of ep, ZeRO stage and capacity at both values, every pair of them once.)"""
    _, ref_losses, ref_aux, ref_norms, ref_tokens = starved_one_rank[capacity]
    for rank, (_, losses, aux, norms, tokens) in enumerate(run_ranks(_train, 4, ep, stage, capacity, True)):
        assert tokens == ref_tokens, rank
        assert losses == pytest.approx(ref_losses, abs=TOL, rel=0), rank
        assert aux == pytest.approx(ref_aux, abs=TOL, rel=0), rank
        assert norms == pytest.approx(ref_norms, abs=TOL, rel=0), rank


@pytest.mark.parametrize("assignments, experts", [(0, 4), (3, 8), (16, 4), (17, 5), (1, 1), (7, 3)])
def test_balanced_loads_deal_every_assignment_and_differ_by_one_at_most(assignments, experts):
    """The planner's dry step's loads (expert_loads.balanced): every assignment dealt, none lost or
    made up, the shares as even as they go (the first ones one more), empty shares included."""
    from distlib.app.model.expert_loads import balanced

    loads = balanced(assignments, experts)
    assert len(loads) == experts and sum(loads) == assignments and min(loads) >= 0
    assert max(loads) - min(loads) <= 1 and loads == sorted(loads, reverse=True)
