"""Qwen3-MoE (``model.family=qwen3_moe``): the model against transformers' Qwen3MoeForCausalLM (loss
with the load-balancing term, the aux loss, logits and every gradient; routing weights
renormalised or not: ``model.norm_topk_prob``), the Hugging Face directory both ways (its file
names, a directory transformers' save_pretrained wrote, the refused layer schedules), and
training: 20 steps at world size 1 fall, and expert parallelism (ep 2, ep 2 with tensor
parallelism and ZeRO-3) stays within 1e-5 of them with the same tokens per expert; an ep 2
checkpoint resumes at one rank and exports to transformers. Offline
(HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from family_models import QWEN3_GQA, built, max_diff, quiet_transformers, tokens
from moe_against_hf import check_one_step, exported_pair
from multiproc import run_ranks
from trainrun import compose_tree, train_each, train_with_margin, train_worlds

from distlib.app.checkpointing import hf_export
from distlib.app.checkpointing.sampling import load_model
from distlib.app.config.model_group import ModelConfig
from distlib.app.model import hf_config as hfc
from distlib.app.model import hf_weights as hfw

transformers = quiet_transformers()
TOL = 1e-5
# family_models' Qwen3 (wide, normed heads: 16 at dim 32) with 4 experts of width 40, each token to
# 2, the top-2 probabilities used as they are (transformers' Qwen3MoeConfig default) and an aux
# term that counts.
QWEN3_MOE = replace(
    QWEN3_GQA, family="qwen3_moe", mlp_hidden=40, n_experts=4, router_aux_loss_coef=0.02, norm_topk_prob=False
)
CONFIGS = {"raw-top2": QWEN3_MOE, "normalised-top1-tied": replace(
    QWEN3_MOE, n_experts=3, top_k=1, norm_topk_prob=True, tie_embeddings=True, head_dim=None
)}  # fmt: skip
FILES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _pair(cfg: ModelConfig, out_dir: Path):
    return exported_pair(cfg, out_dir, transformers)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_aux_loss_logits_and_gradients_match_transformers(name, tmp_path):
    """One training step's loss (cross-entropy + coef x load-balancing loss), the aux loss, every
    gradient and the logits, within 1e-5 of Qwen3MoeForCausalLM(output_router_logits=True)."""
    check_one_step(CONFIGS[name], tmp_path, transformers)


def test_the_routing_weights_are_renormalised_only_when_asked():
    """norm_topk_prob=false keeps the top-k probabilities (summing to less than 1); true divides
    them by their sum; the choice of experts is the same."""
    raw = built(QWEN3_MOE, seed=1)
    normalised = built(replace(QWEN3_MOE, norm_topk_prob=True), seed=1)
    x = torch.randn(9, QWEN3_MOE.dim, generator=torch.Generator().manual_seed(4))
    ids, weights, probs = raw.blocks[0].mlp.route(x)
    ids2, weights2, _ = normalised.blocks[0].mlp.route(x)
    assert torch.equal(ids, ids2) and torch.equal(weights, torch.gather(probs, 1, ids))
    assert (weights.sum(dim=-1) < 1).all()
    assert torch.allclose(weights2, weights / weights.sum(dim=-1, keepdim=True))


def test_the_hugging_face_directory_both_ways(tmp_path):
    """Export: Qwen3-MoE's config.json and file names (mlp.gate, mlp.experts.{e}.gate_proj/up_proj/
    down_proj, the head norms); import: our directory back to the same config and bytes, and a
    directory transformers' save_pretrained wrote to the same weights."""
    ours, theirs = _pair(QWEN3_MOE, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    keys = ["model_type", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size"]
    keys.append("norm_topk_prob")
    assert [config[k] for k in keys] == ["qwen3_moe", 4, 2, 40, False]
    assert config["decoder_sparse_step"] == 1 and config["mlp_only_layers"] == []
    names = {theirs for _, theirs, _ in hfw.name_map(QWEN3_MOE)}
    layer = "model.layers.1."
    assert {layer + "mlp.gate.weight", layer + "self_attn.q_norm.weight"} <= names
    assert {f"{layer}mlp.experts.3.{w}.weight" for w in FILES.values()} <= names
    mine = ours.state_dict()
    theirs.save_pretrained(tmp_path / "theirs")
    for directory in (tmp_path / "ours", tmp_path / "theirs"):
        fields, state = hfw.load_hf_dir(directory)
        assert ModelConfig(**fields) == QWEN3_MOE
        assert state.keys() == mine.keys() and all(torch.equal(state[k], mine[k]) for k in mine)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 (every block sparse here)"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers=[0] (every block sparse here)"),
        ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=true"),
    ],
)
def test_import_refuses_layer_schedules_it_does_not_compute(change, message):
    with pytest.raises(hfc.HFError) as err:
        hfc.config_fields(hfc.hf_config(QWEN3_MOE) | change)
    assert str(err.value).startswith(f"cannot convert exactly: {message}")


# -- training ------------------------------------------------------------------------------------------

# seed 11: the reference's smallest top-k margin is 2.5e-6, checked (a near tie flips with rounding)
BASE = ["model=qwen3_moe", "seed=11", "train.steps=20", "checkpoint.every_steps=0"]
BASE += ["checkpoint.verify_resume=false", "metrics.progress_every=0"]
# 2: ep 2, saving at step 10 (resumed at one rank and exported below); 4: ep 2 x dp 2 x tp 2 with
# sequence parallelism
LAYOUTS = {
    2: [["dist.ep=2", "checkpoint.every_steps=10"]],
    4: [["dist.ep=2", "dist.tp=2", "dist.sp=true", "zero=stage3"]],
}
MARGIN = 1e-6  # the smallest gap between a token's k-th and (k+1)-th router probability to accept


def _follows(run: dict, ref: dict, what) -> None:
    worst = max(abs(a - b) / b for a, b in zip(run["losses"], ref["losses"][-len(run["losses"]) :]))
    assert worst <= TOL, (what, worst)
    for r, want in zip(run["records"], ref["records"][-len(run["records"]) :]):
        assert r["expert_tokens"] == want["expert_tokens"], (what, r["step"])
        assert r["aux_loss"] == pytest.approx(want["aux_loss"], rel=TOL)


@pytest.mark.slow
def test_expert_parallelism_trains_one_ranks_losses_resumes_and_exports(tmp_path):
    """ep 2 over 2 data-parallel ranks, and ep 2 with 2 tensor-parallel ranks and sequence
    parallelism at ZeRO-3 (the head norms' and the block norms' gradients summed over tp, each
    expert split by hidden units, the router on the gathered tokens): 20 steps within 1e-5 of
    one rank, the tokens per expert the same and the aux loss within 1e-5. The ep 2 run's step-10
    checkpoint (each rank's experts under their names) resumes at one rank for steps 11-20 as
    the reference's, and exports to a directory transformers loads with our logits."""
    tree = compose_tree([*BASE, "dist.world_size=1"])
    ref = run_ranks(train_with_margin, 1, tree, str(tmp_path / "ref"))[0]
    assert ref["margin"] > MARGIN, f"the reference has a near-tied routing choice ({ref['margin']:.1e})"
    assert ref["losses"][-1] < 0.6 * ref["losses"][0]
    runs = train_worlds(BASE, LAYOUTS, tmp_path)
    for world, layouts in LAYOUTS.items():
        for layout, run in zip(layouts, runs[world]):
            assert len(run["losses"]) == 20, layout
            _follows(run, ref, layout)
    ckpt = tmp_path / "ws2" / "0" / "checkpoints" / "step_00000010"
    resumed = compose_tree([*BASE, "dist.world_size=1", f"checkpoint.resume={ckpt}"])
    (again,) = run_ranks(train_each, 1, [resumed], str(tmp_path / "resumed"))[0]
    assert len(again["losses"]) == 10
    _follows(again, ref, "ep 2 -> 1 rank")
    hf_export.export(ckpt, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = load_model(ckpt)
    x = tokens(ours.cfg, 2, ours.cfg.seq_len, 9)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x).logits) <= TOL
