"""``dist.ep`` through the real Trainer: a Mixtral whose experts split over ep of the data-parallel
ranks trains what one rank trains, and its checkpoints load at any ep (each rank saves what it holds).

20 steps of model=mixtral_tiny (2 blocks) at ep 2 and 4 over 4 ranks (ZeRO 0-3, overlap, activation
checkpointing, async saves, context parallelism, tensor and sequence parallelism) and ep 2 over 2 ranks, some
with dropout: every step's loss within 1e-5 of world size 1's, its aux loss too, and the tokens per
expert identical. A checkpoint saved at ep 2
holds every rank's dense partition and its experts' (every expert once, its manifest saying where; it
verifies with scripts/ckpt.py, consolidates into the ep 2 run's weights bit for bit, and exports to a
directory transformers' Mixtral runs with our logits); resumes across ep are tests/test_any_to_any.py's.
A tp 2 x ep 2 checkpoint continues at tp 2 alone; gradient accumulation, bf16 and model.init_from
(below, each against what it can be held to). Experts that receive no token (issue #37): a router
forced to starve them, and a transformers-made Mixtral that starves one by itself. Bad layouts are
one line."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
from forkrun import run_script
from multiproc import run_ranks
from plan_check import matrix_misses
from safetensors.torch import load_file
from trainrun import (
    MIXTRAL_2,
    compose_tree,
    one_rank_reference,
    starving_router,
    train_each,
    train_with_margin,
    train_worlds,
)

from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.observe import summary
from distlib.app.runtime.hooks import StepHooks
from distlib.app.trainer import Trainer
from distlib.checkpoint import relayout
from distlib.launch.torchrun import use_deterministic_kernels

REL = 1e-5
# mixtral_tiny at 2 blocks, seed 21: no near-tied top-k choice in 20 steps (trainrun.MIXTRAL_2).
BASE = MIXTRAL_2
# Dropout on the attention weights (masks that do not depend on the layout): seed 16, whose smallest
# top-k margin over the 20 steps is 6.6e-6 (trainrun.train_with_margin; seeds 10-22 measured 4.5e-8 to
# 6.6e-6 at 2 blocks). A seed's margin is not all: at 4 blocks seed 12 (margin 1.4e-6) kept its
# routing at cp 2 x ep 4 ZeRO-3 on an AVX2 EPYC but its losses drifted to 1.4e-5 of one rank's (ep 4
# alone 4.6e-6, cp 2 alone 8.5e-6, all peaking at the same steps: a trajectory along which Adam
# amplifies the gradients' summation-order rounding), where seed 22's stayed within 6.5e-7.
DROPOUT = ["seed=16", "model.dropout=0.1"]
MARGIN = 1e-6  # the references' smallest top-k margin must exceed it (a near tie flips with rounding)
LAYOUTS = {  # (world size 1: the references, without and with dropout, trainrun.one_rank_reference)
    2: [["dist.ep=2", *DROPOUT]],  # (ep 2 without dropout: over 4 ranks below)
    4: [
        ["dist.ep=4", "zero=stage0", "checkpoint.every_steps=5", "checkpoint.async_save=true"],
        # sequence parallelism: the experts split by hidden units and over the expert group; its
        # step-10 checkpoint continues at tp 2 alone (below). (With ZeRO 3, activation checkpointing
        # and accumulation as well it took 27.6 s alone, against 8.5 s.)
        ["dist.tp=2", "dist.sp=true", "dist.ep=2", "checkpoint.every_steps=10"],
        ["dist.ep=2", "zero=stage3", "model.activation_checkpointing=blocks"],
        ["dist.cp=2", "dist.ep=4", "zero=stage3", *DROPOUT],  # the expert group spans dp x cp
        ["dist.ep=4", "zero=stage2", "zero.overlap=true"],
    ],
}
TP_EP = 1  # that layout's index: its step-10 checkpoint is in <root>/ws4/1/checkpoints


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    refs = [one_rank_reference(tmp_path_factory, BASE), one_rank_reference(tmp_path_factory, BASE + DROPOUT)]
    root = tmp_path_factory.mktemp("ep")
    return {1: refs, "root": root} | train_worlds(BASE, LAYOUTS, root)


@pytest.mark.slow
def test_every_expert_parallel_layout_trains_to_one_ranks_losses(runs):
    for ref in runs[1]:
        assert ref["losses"][-1] < 0.5 * ref["losses"][0]
        assert ref["margin"] > MARGIN, f"a reference has a near-tied routing choice ({ref['margin']:.1e})"
    assert max(abs(a - b) for a, b in zip(runs[1][0]["losses"], runs[1][1]["losses"])) > 1e-3
    for world in (2, 4):
        for layout, run in zip(LAYOUTS[world], runs[world]):
            ref = runs[1][DROPOUT[-1] in layout]
            worst = max(abs(a - b) / b for a, b in zip(run["losses"], ref["losses"]))
            assert len(run["losses"]) == 20 and worst <= REL, (world, layout, worst)
            for r, want in zip(run["records"], ref["records"]):
                assert r["expert_tokens"] == want["expert_tokens"], (world, layout, r["step"])
                assert r["aux_loss"] == pytest.approx(want["aux_loss"], rel=REL), (world, layout)


def _save(comm, root: str) -> dict:
    """Save at step 10 at ep 2: the manifest, the memory table and this rank's parameters."""
    use_deterministic_kernels()
    tree = compose_tree([*BASE, f"dist.world_size={comm.size}", "dist.ep=2", "checkpoint.every_steps=10"])
    tree["train"]["steps"] = 10
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        trainer = Trainer(RunConfig.from_dict(tree), comm, Path(root) / "saved")
        result = trainer.run()
    ckpt = Path(root) / "saved" / "checkpoints" / "step_00000010"
    return {
        "manifest": json.loads((ckpt / "manifest.json").read_text()),
        "path": str(ckpt),
        "table": summary.memory_table(result, trainer.cfg.zero.stage),
        # this rank's experts and the dense parameters at the save (numpy: tensors do not cross the queue)
        "params": {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()},
    }


@pytest.mark.slow
def test_a_checkpoint_saved_at_ep2_holds_every_expert_once_and_exports(tmp_path):
    """Its resumes at other layouts (ep 4, ep 1, over 2 ranks) are tests/test_any_to_any.py's cycle."""
    ranks = run_ranks(_save, 4, str(tmp_path / "four"), timeout_s=900)
    got = ranks[0]
    manifest = got["manifest"]
    assert manifest["parallel"]["ep"] == 2 and manifest["world_size"] == 4
    # the memory table: measured bytes within each group's formula, the groups named
    table = got["table"].splitlines()
    assert "P and N of each group" in table[0]
    assert table[1].startswith("  formula: params dense 4P + experts 4P")
    assert [row.split()[-1] for row in table[3:7]] == ["yes"] * 4, got["table"]
    # what each rank holds: the dense parameters over the 4 batch ranks ("layout"), and the experts
    # of each expert-group rank over the 2 ranks holding them, under "experts." (group_holdings)
    assert not any(".mlp.experts." in p["name"] for p in manifest["layout"]["params"])
    held = manifest["group_holdings"]
    assert [(h["prefix"], len(h["files"])) for h in held] == [("experts.", 2)] * 2
    assert sorted(f for h in held for f in h["files"]) == [0, 1, 2, 3]
    names = [slot.name for slot in relayout.whole_layout(manifest).slots]  # every expert of every block, once
    model = RunConfig.from_dict(compose_tree(BASE)).model  # 3 weight matrices per expert
    experts = model.n_layers * model.n_experts * 3
    assert sum(".mlp.experts." in n for n in names) == experts and len(set(names)) == len(names)
    proc = run_script("scripts/ckpt.py", "verify", got["path"])
    assert proc.returncode == 0, proc.stderr
    # consolidated, it is the ep 2 run's weights at the save, bit for bit: each expert from a rank
    # that held it
    proc = run_script("scripts/ckpt.py", "consolidate", got["path"], str(tmp_path / "whole"))
    assert proc.returncode == 0, proc.stderr
    weights = load_file(tmp_path / "whole" / "model.safetensors")
    assert sorted(weights) == sorted(names)
    proc = run_script("scripts/ckpt.py", "inspect", got["path"])  # the holdings, and every parameter counted
    assert proc.stdout.count("experts. holding of tensor rank 0: ") == 2, proc.stdout
    assert f"total: {sum(w.numel() for w in weights.values())} parameters" in proc.stdout, proc.stdout
    held = {}
    for r in ranks:
        held.update(r["params"])
    assert sorted(held) == sorted(names) and sum(len(r["params"]) for r in ranks) > len(names)
    for n in names:
        assert torch.equal(weights[n], torch.from_numpy(held[n])), n
    _transformers_runs_the_export(got["path"], weights, manifest, tmp_path)


DEEPSEEK_PP = ["model=deepseek_v3_tiny", "dist.world_size=4", "dist.pp=2", "dist.ep=2", "train.grad_accum=2"]
INTERLEAVED = ["dist.pp_schedule=interleaved", "dist.pp_virtual=2"]


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["model=llama", "dist.ep=2"],
            "dist.ep=2 needs a model with experts (model.family=mixtral, qwen3_moe or deepseek_v3), "
            "not llama",
        ),
        (
            ["model=mixtral_tiny", "dist.ep=4", "model.n_experts=6"],
            "dist.ep=4 must divide model.n_experts=6",
        ),
        (
            ["model=mixtral_tiny", "dist.ep=3"],
            "invalid parallel layout: dist.ep=3 must divide the batch ranks",
        ),
        (
            ["model=mixtral_tiny", "dist.ep=2", "dist.cp=2", "model.capacity_factor=1.0"],
            "model.capacity_factor=1.0 is not supported with dist.cp=2",
        ),
        (["model=mixtral_tiny", "dist.ep=0"], "dist.ep must be an integer >= 1, got 0"),
        (  # the dense block fills the first stage
            [*DEEPSEEK_PP, "model.n_layers=2"],
            "dist.ep=2 with dist.pp=2: pipeline rank 0 holds blocks [0], none with experts",
        ),
        (  # interleaved: rank 0 holds global stages 0 and 2 (blocks 0 and 2), both dense
            [*DEEPSEEK_PP, *INTERLEAVED, "model.first_k_dense_replace=3"],
            "dist.ep=2 with dist.pp=2: pipeline rank 0 holds blocks [0, 2], none with experts",
        ),
    ],
)
def test_bad_expert_layouts_are_one_line(overrides, line):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(compose_tree(overrides))
    assert str(err.value).startswith(line) and "\n" not in str(err.value), err.value


@pytest.mark.parametrize("blocks", [["model.n_layers=4"], [*INTERLEAVED, "model.first_k_dense_replace=2"]])
def test_dense_blocks_on_a_stage_with_an_moe_block_are_accepted(blocks):
    """Each pipeline rank holds an MoE block: 4 blocks over 2 stages (the dense one and an MoE one
    on rank 0), and interleaved with 2 dense blocks (rank 0: blocks 0 and 2, rank 1: 1 and 3)."""
    assert RunConfig.from_dict(compose_tree([*DEEPSEEK_PP, *blocks])).dist.pp == 2


def _transformers_runs_the_export(ckpt: str, weights: dict, manifest: dict, tmp_path: Path) -> None:
    """scripts/export_hf.py writes the ep 2 checkpoint as a directory MixtralForCausalLM loads,
    whose logits are our model's with the consolidated weights."""
    from family_models import max_diff, quiet_transformers, tokens

    from distlib.app.config.model_group import ModelConfig
    from distlib.app.model import families

    transformers = quiet_transformers()
    proc = run_script("scripts/export_hf.py", ckpt, str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    cfg = ModelConfig(**manifest["model"])
    ours = families.build(cfg, 0)
    ours.load_state_dict(weights)
    x = tokens(cfg, 2, cfg.seq_len, 5)
    with torch.no_grad():
        assert max_diff(hf.eval()(input_ids=x).logits, ours.eval()(x)) <= 1e-5


# Accumulation (each micro-batch's load-balancing term, counted over the batch ranks' micro-batch)
# against ep 1 on the same ranks, which groups the samples into micro-batches alike, over 10 steps.
# bf16: its first step against world size 1's fp32 one within bf16 precision, and 10 steps train;
# no longer bound, as a bf16 rounding flips near-tied top-k choices (measured: one rank's own bf16
# run is 6% from its fp32 run by step 20, ep 4's 9.5%).
BF16_REL = 0.01
MORE = [
    ["dist.ep=2", "train.grad_accum=2", "train.steps=10"],
    ["dist.ep=4", "train.dtype=bf16", "zero=stage3", "train.steps=10"],
]


@pytest.mark.slow
def test_accumulation_and_bf16_under_expert_parallelism(runs, tmp_path):
    accum, bf16 = run_ranks(
        train_each,
        4,
        [compose_tree([*BASE, *layout, "dist.world_size=4"]) for layout in MORE],
        str(tmp_path),
        timeout_s=600,
    )[0]
    reference = runs[1][0]  # one rank, one micro-batch: the session's 20 steps (the first 10 here)
    worst = max(abs(a - b) / b for a, b in zip(accum["losses"], reference["losses"]))
    assert len(accum["losses"]) == 10 and worst <= REL, f"ep 2 with accumulation: {worst:.2e} from one rank's"
    assert [r["expert_tokens"] for r in accum["records"]] == [
        r["expert_tokens"] for r in reference["records"][:10]
    ]
    first, fp32 = bf16["losses"][0], runs[1][0]["losses"][0]
    assert 0 < abs(first - fp32) / fp32 <= BF16_REL, (first, fp32)
    assert len(bf16["losses"]) == 10 and bf16["losses"][-1] < 0.75 * first


def _first_loss(comm, tree: dict, run_dir: str) -> float:
    return train_each(comm, [tree], run_dir)[0]["losses"][0]


@pytest.mark.slow
def test_init_from_a_transformers_mixtral_at_ep2_is_ep1s_first_step(tmp_path):
    _save_transformers_mixtral(tmp_path / "hf", 0, 1, **_HF_TINY)
    run = [o for o in BASE if not o.startswith("model")]  # the model is the directory's
    base = [f"model.init_from={tmp_path / 'hf'}", *run, "train.steps=1", "dist.world_size=4"]
    ep1, ep2 = (
        run_ranks(_first_loss, 4, compose_tree([*base, f"dist.ep={ep}"]), str(tmp_path / f"ep{ep}"))[0]
        for ep in (1, 2)
    )
    # (a wrongly placed expert would change the loss by far more)
    assert abs(ep1 - ep2) <= 1e-6, (ep1, ep2)


@pytest.mark.slow
def test_a_tensor_and_expert_parallel_checkpoint_continues_at_tensor_parallelism_alone(runs, tmp_path):
    """The matrix's tp 2 x ep 2 run with sequence parallelism (the experts split both ways) saved
    step 10; tp 2 alone (no sp, no ep) over 4 ranks resumes it for steps 11-20 within 1e-5 of one
    rank, the same tokens per expert."""
    assert {"dist.tp=2", "dist.ep=2", "checkpoint.every_steps=10"} <= set(LAYOUTS[4][TP_EP])
    saved = runs["root"] / "ws4" / str(TP_EP) / "checkpoints" / "step_00000010"
    tree = compose_tree([*BASE, "dist.tp=2", f"checkpoint.resume={saved}", "dist.world_size=4"])
    (resumed,) = run_ranks(train_each, 4, [tree], str(tmp_path), timeout_s=600)[0]
    ref = runs[1][0]
    worst = max(abs(a - b) / b for a, b in zip(resumed["losses"], ref["losses"][10:]))
    assert len(resumed["losses"]) == 10 and worst <= REL, worst
    want = [r["expert_tokens"] for r in ref["records"][10:]]
    assert [r["expert_tokens"] for r in resumed["records"]] == want


def _save_transformers_mixtral(path: Path, seed: int, perturb: int | None = None, **sizes) -> None:
    """A MixtralForCausalLM of ``sizes`` made by transformers from ``seed`` (its noise added with
    ``perturb``: family_models.perturb_), saved to ``path``."""
    from family_models import perturb_, quiet_transformers

    transformers = quiet_transformers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**sizes))
        (model if perturb is None else perturb_(model, perturb)).save_pretrained(path)


_HF_SHAPE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
_HF_SHAPE |= {"num_local_experts": 4, "num_experts_per_tok": 2}
_HF_TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "max_position_embeddings": 16}
_HF_TINY |= _HF_SHAPE
# The Mixtral issue #37 made with transformers (nothing of ours in it): at ep 4, no rank routes a
# token to expert 1 at step 4, so the rank holding it receives nothing.
_ISSUE_37 = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 64}
_ISSUE_37 |= _HF_SHAPE | {"tie_word_embeddings": False}


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "step"]


@pytest.mark.slow
def test_a_transformers_mixtral_with_a_starved_expert_trains_at_ep4_and_ep2(tmp_path):
    from e2e import train

    _save_transformers_mixtral(tmp_path / "mixtral-hf", 11, **_ISSUE_37)
    args = [
        "model=mixtral",
        f"model.init_from={tmp_path / 'mixtral-hf'}",
        "model.seq_len=32",
        "data=text",
        f"data.cache_dir={tmp_path / 'cache'}",  # (the token cache, not beside data/sample.txt)
        "train.global_batch=8",
        "train.steps=10",
    ]
    # issue #37's command as typed (its run directory aside): the launcher and its four workers
    proc = train(tmp_path / "ep4", "dist.world_size=4", *args, "dist.ep=4", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ep4 = _records(tmp_path / "ep4")
    runs = train_worlds(
        [*args, "metrics.progress_every=0"], {1: [[]], 4: [["dist.ep=2"]]}, tmp_path / "forked"
    )
    ref, ep2 = runs[1][0]["records"], runs[4][0]["records"]
    starved = [r["step"] for r in ref if any(0 in block for block in r["expert_tokens"])]
    assert starved, "some step must leave an expert without a token for the test to mean anything"
    for name, run in (("ep4", ep4), ("ep2", ep2)):
        assert [r["expert_tokens"] for r in run] == [r["expert_tokens"] for r in ref], name
        worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(run, ref))
        assert len(run) == 10 and worst <= REL, (name, worst)


# The real Trainer with a router forced to starve experts (issue #37), model=mixtral_tiny: 8
# experts, 16 samples a step, 4 per rank over 4 batch ranks. Step (as the trainer numbers it) ->
# {global sample (None: every sample): the experts its tokens may not choose}.
FORCED = {
    3: {None: {4, 5, 6, 7}},  # ep 2's second rank and ep 4's last two receive nothing
    4: {None: {4, 5, 6, 7}},
    6: {None: {2, 3}},  # ep 4's second rank receives nothing
    9: {s: {0} for s in range(4)},  # expert 0 gets no token from rank 0's samples only
    10: {s: {4, 5, 6, 7} for s in range(4, 8)},  # rank 1 sends ep 2's second rank nothing
}
FORCED_STEPS = ["train.steps=10"]


class _Clock(StepHooks):
    def __init__(self):
        self.step = 0

    def before_step(self, step: int) -> None:
        self.step = step


def _train_forced(comm, tree: dict, run_dir: str, margin: bool) -> dict:
    """One layout through the real Trainer (trainrun), every MoE router's logits masked to -inf
    where FORCED bans an expert at this step for a row's sample."""
    from distlib.app.model import moe

    clock = _Clock()
    first = comm.rank * tree["train"]["global_batch"] // comm.size  # (batch ranks = every rank)
    mask = starving_router(FORCED, lambda: clock.step, first, tree["model"]["seq_len"])

    built = moe.MoE.__init__

    def init(self, cfg, **strategy):
        built(self, cfg, **strategy)
        self.gate.register_forward_hook(mask)

    moe.MoE.__init__ = init  # (in this forked rank only)
    if margin:
        return train_with_margin(comm, tree, run_dir, clock)
    return train_each(comm, [tree], run_dir, clock)[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["dist.ep=2", "zero=stage0"], ["dist.ep=4", "zero=stage3", "model.capacity_factor=1.0"]],
    ids=["ep2-z0", "ep4-z3-capacity"],
)
def test_the_trainer_with_starved_experts_trains_one_ranks_losses(tmp_path, layout):
    capacity = [o for o in layout if o.startswith("model.capacity")]
    ref = run_ranks(
        _train_forced, 1, compose_tree([*BASE, *FORCED_STEPS, *capacity]), str(tmp_path / "ref"), True
    )[0]
    assert ref["margin"] > 1e-6, f"the reference has a near-tied top-k choice ({ref['margin']:.1e})"
    for record in ref["records"]:
        everywhere = FORCED.get(record["step"], {}).get(None, set())
        starved = {e for e in range(8) if all(block[e] == 0 for block in record["expert_tokens"])}
        assert starved == everywhere, (record["step"], starved)
    tree = compose_tree([*BASE, *FORCED_STEPS, *layout, "dist.world_size=4"])
    run = run_ranks(_train_forced, 4, tree, str(tmp_path / "run"), False, timeout_s=600)[0]
    assert [r["expert_tokens"] for r in run["records"]] == [r["expert_tokens"] for r in ref["records"]]
    worst = max(abs(a - b) / b for a, b in zip(run["losses"], ref["losses"]))
    assert len(run["losses"]) == 10 and worst <= REL, worst


def test_the_planner_gives_every_ranks_model_states(runs):
    """scripts/plan.py's figures (tests/plan_check.py) for every layout above and the references,
    rank by rank: to the byte (zero.overlap at ZeRO-2: at most them)."""
    assert matrix_misses([*runs[1], *runs[2], *runs[4]]) == {}
