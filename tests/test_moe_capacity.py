"""An expert capacity (``model.capacity_factor``, GShard's): each expert takes at most
ceil(factor x seq_len x top_k / n_experts) of one sequence's assignments, first choices first in
token order, and drops the rest.

The choice of what is dropped against a plain loop over the rule; the layer's output against the
weighted sum of each token's kept experts; the dropped counts of a training run identical in every
layout that keeps sequences whole (the real Trainer at world size 1 and 2, and the expert-parallel
layer at ep 2 and 4), the losses within 1e-5; the config's refusals."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from family_models import max_diff, perturb_
from multiproc import run_ranks
from trainrun import compose_tree, train_with_margin, train_worlds

from distlib.app.config.model_group import ModelConfig
from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.model import moe

TOL = 1e-5
MOE = ModelConfig(family="mixtral", vocab_size=64, seq_len=12, dim=16, n_heads=2, n_layers=1, n_experts=4)


def _kept_by_loop(ids: torch.Tensor, samples: int, capacity: int) -> torch.Tensor:
    """The rule one assignment at a time: per sample, slot by slot, token by token."""
    tokens, k = ids.shape
    per = tokens // samples
    kept = torch.zeros(tokens, k, dtype=torch.bool)
    for s in range(samples):
        taken = [0] * MOE.n_experts
        for j in range(k):
            for t in range(s * per, (s + 1) * per):
                e = int(ids[t, j])
                kept[t, j] = taken[e] < capacity
                taken[e] += 1
    return kept


@pytest.mark.parametrize("factor, top_k", [(1.0, 2), (0.5, 2), (1.25, 1), (0.3, 3)])
def test_what_is_dropped_follows_the_rule(factor, top_k):
    cfg = replace(MOE, capacity_factor=factor, top_k=top_k)
    layer = moe.MoE(cfg)
    samples = 3
    scores = torch.randn(samples * cfg.seq_len, cfg.n_experts, generator=torch.Generator().manual_seed(4))
    ids = scores.topk(top_k, dim=-1).indices
    capacity = math.ceil(factor * cfg.seq_len * top_k / cfg.n_experts)
    want = _kept_by_loop(ids, samples, capacity)
    assert torch.equal(layer.within_capacity(ids, samples), want)
    assert 0 < int((~want).sum()) < want.numel(), "the case must drop some and keep some"


def test_the_output_is_the_weighted_sum_of_the_kept_experts_only():
    cfg = replace(MOE, capacity_factor=0.5)
    layer = perturb_(moe.MoE(cfg), 1)
    x = torch.randn(2, cfg.seq_len, cfg.dim, generator=torch.Generator().manual_seed(2))
    flat = x.reshape(-1, cfg.dim)
    with torch.no_grad():
        out = layer(x).reshape(-1, cfg.dim)
        ids, weights, _ = layer.route(flat)
        kept = layer.within_capacity(ids, 2)
        want = torch.stack(
            [
                sum(
                    (weights[t, j] * layer.experts[int(ids[t, j])](flat[t]) for j in range(2) if kept[t, j]),
                    torch.zeros(cfg.dim),
                )
                for t in range(flat.shape[0])
            ]
        )
    assert int(layer.last_dropped) == int((~kept).sum()) > 0
    assert layer.last_counts.tolist() == [int((ids == e).sum()) for e in range(4)]  # as routed
    assert max_diff(out, want) <= 1e-6
    dropless = moe.MoE(MOE)
    dropless.load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert max_diff(dropless(x).reshape(-1, cfg.dim), want) > 1e-3  # the drops change the output


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.capacity_factor=0"], "model.capacity_factor must be null or a number > 0, got 0"),
        (["model=llama", "model.capacity_factor=1.0"], "model.capacity_factor=1.0 does not apply to"),
        (
            ["model.capacity_factor=1.0", "dist.world_size=2", "dist.cp=2"],
            "model.capacity_factor=1.0 is not supported with dist.cp=2",
        ),
    ],
)
def test_bad_input_is_one_config_error(overrides, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(compose_tree(["model=mixtral", *overrides]))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value


# -- training ------------------------------------------------------------------------------------------

# Seed 12: the reference's smallest top-k margin is 6.0e-6 (measured here: the default seed's is
# 3.9e-7, seed 10's 9.2e-7; trainrun.train_with_margin says why it matters), and the test checks it.
MARGIN = 1e-6
BASE = ["model=mixtral_tiny", "seed=12", "model.capacity_factor=1.0", "train.steps=20"]
BASE += ["checkpoint.every_steps=0", "checkpoint.verify_resume=false", "metrics.progress_every=0"]
LAYOUTS = {2: [["zero=stage1"], ["zero=stage3", "model.activation_checkpointing=blocks"]]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("capacity")
    ref = run_ranks(train_with_margin, 1, compose_tree([*BASE, "dist.world_size=1"]), str(root / "ref"))[0]
    return ref, train_worlds(BASE, LAYOUTS, root)


@pytest.mark.slow
def test_every_layout_drops_what_one_rank_drops(runs):
    ref, worlds = runs
    assert ref["margin"] > MARGIN, f"the reference has a near-tied top-k choice ({ref['margin']:.1e})"
    dropped = [r["dropped_tokens"] for r in ref["records"]]
    assert sum(map(sum, dropped)) > 0, "the run must drop some assignments"
    assert ref["losses"][-1] < 0.5 * ref["losses"][0]
    for layout, run in zip(LAYOUTS[2], worlds[2]):
        assert [r["dropped_tokens"] for r in run["records"]] == dropped, layout
        worst = max(abs(a - b) / b for a, b in zip(run["losses"], ref["losses"]))
        assert worst <= TOL, (layout, worst)
