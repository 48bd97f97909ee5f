"""With experts the planner's bytes are a bound where the router decides them (``expert_loads``):
the step peak everywhere, and the activations over expert-parallel ranks, come from the experts'
hottest loads, the most rows any routing sends a rank's experts (``expert_loads.hottest``).

Here a router forced to send every token to experts 0 .. top_k - 1 (the ones expert-parallel rank 0
holds) makes those loads in a real run: the rank holding them measures the planned bytes to the
byte, and every other rank at most them. Unforced runs (every matrix's, ``plan_check``) stay at or
under the bound; with a capacity, at or under it too.
"""

from __future__ import annotations

import random

import pytest
import torch
from plan_check import ONE_STEP, measure
from trainrun import compose_tree

from distlib.app.config.run import RunConfig
from distlib.app.model import expert_loads
from distlib.app.plan.activations import rank_activations
from distlib.app.plan.step_peak import rank_step_peaks
from distlib.parallel.expert_parallel import held_experts

FORCED = [*ONE_STEP, "model=mixtral_tiny"]
# (layout, whether the forced routing is the hottest: not under a capacity, which drops the most of
# it where the bound fills the rank's other experts to their capacity)
LAYOUTS = [
    ("dist.ep=1", True),
    ("dist.ep=2 zero=stage2", True),
    ("dist.ep=4 zero=stage3", True),
    ("dist.ep=2 dist.pp=2 train.grad_accum=2", True),
    ("dist.ep=2 dist.tp=2 dist.sp=true", True),
    ("dist.ep=2 model.capacity_factor=1.0", False),
]


def _forced(comm, trees: list[dict], root: str) -> list[list[dict]]:
    """Each tree trained one step with every token routed to experts 0 .. top_k - 1."""
    from distlib.app.model import routers

    real = routers.SoftmaxTopK.logits

    def skewed(self, gate, x):
        logits = real(self, gate, x)
        skew = torch.zeros(logits.shape[-1], device=logits.device)
        skew[: self.top_k] = 100.0 - torch.arange(self.top_k, device=logits.device)
        return logits + skew

    routers.SoftmaxTopK.logits = skewed  # (in this forked rank only)
    return measure(comm, trees, root)


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    from multiproc import run_ranks

    trees = [compose_tree([*FORCED, *layout.split()]) for layout, _ in LAYOUTS]
    root = tmp_path_factory.mktemp("hottest")
    return trees, run_ranks(_forced, 4, trees, str(root), timeout_s=600)[0]


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[layout for layout, _ in LAYOUTS])
def test_the_hottest_routing_measures_the_bound_and_no_rank_more(forced, index):
    trees, runs = forced
    cfg = RunConfig.from_dict(trees[index])
    hottest = LAYOUTS[index][1]
    for what, planned in (("activations", rank_activations(cfg)), ("step_peak", rank_step_peaks(cfg))):
        measured = [rank[what] for rank in runs[index]]
        assert all(m <= p for m, p in zip(measured, planned)), (what, measured, planned)
        if not hottest:
            continue
        for stage in range(cfg.dist.pp):  # the stage's rank holding experts 0 .. top_k - 1: the bound
            ranks = [r for r in range(cfg.dist.world_size) if cfg.layout.coords(r)["pp"] == stage]
            assert max(measured[r] for r in ranks) == planned[ranks[0]], (what, stage, measured, planned)


def _routed(rng: random.Random) -> expert_loads.Routed:
    tokens, k = rng.randint(0, 9), rng.randint(1, 4)
    return expert_loads.Routed(tokens, k, rng.randint(0, tokens))


def _some_routing(routed: expert_loads.Routed, experts: int, rng: random.Random) -> list[int]:
    """Rows per expert of one random routing: each token to ``top_k`` distinct experts, an expert
    keeping at most ``most`` (the rest dropped, as a capacity does)."""
    counts = [0] * experts
    for _ in range(routed.tokens):
        for e in rng.sample(range(experts), routed.top_k):
            counts[e] += counts[e] < routed.most
    return counts


def test_no_routing_gives_a_rank_more_than_the_hottest():
    rng = random.Random(7)
    for _ in range(2000):
        routed, ranks = _routed(rng), rng.choice([1, 2, 4])
        experts = ranks * rng.randint(1, 4)
        if routed.top_k > experts:
            continue
        rank = rng.randrange(ranks)
        held = held_experts(experts, ranks, rank) if ranks > 1 else range(0)
        hot = expert_loads.hottest(routed, experts, held)
        mine = list(held) or range(experts)
        assert sum(hot) <= routed.assignments and max(hot, default=0) <= routed.most
        for _ in range(5):
            some = _some_routing(routed, experts, rng)
            assert sum(some[e] for e in mine) <= sum(hot[e] for e in mine)
            assert max((some[e] for e in mine), default=0) <= max((hot[e] for e in mine), default=0)
            assert sum(some) <= sum(hot)


def test_the_hottest_of_nothing_is_nothing():
    assert expert_loads.hottest(expert_loads.Routed(0, 2, 0), 4, range(2, 4)) == [0, 0, 0, 0]
    assert expert_loads.hottest(expert_loads.Routed(3, 2, 0), 4, range(0)) == [0, 0, 0, 0]
    assert expert_loads.hottest(expert_loads.Routed(3, 2, 3), 4, range(2, 4)) == [0, 0, 3, 3]
    assert expert_loads.hottest(expert_loads.Routed(3, 3, 2), 4, range(0)) == [2, 2, 2, 2]
