"""model.activation_checkpointing=blocks: the same losses and parameters bit for bit (dropout on,
so the recomputation must replay the RNG) at ZeRO-1, at ZeRO-3 (whose recomputation needs the
block's parameters gathered again) and with tensor parallelism; and fewer activation bytes kept
for backward, as measured and printed in the memory profile."""

import json
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from trainrun import compose_tree

from distlib.app.config.model_group import ModelConfig
from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.model.minigpt import build_model
from distlib.app.observe import summary
from distlib.app.observe.activations import ActivationMeter
from distlib.app.trainer import Trainer
from distlib.launch.torchrun import use_deterministic_kernels

BASE = [
    "dist.world_size=2",
    "train.steps=3",
    "checkpoint.every_steps=0",
    "metrics.progress_every=0",
    "model.dropout=0.1",
    "train.monotone_until_step=0",
]


def _run(comm, tree, run_dir):
    use_deterministic_kernels()  # the product's switch: the same ATen flag, without torch._inductor
    cfg = RunConfig.from_dict(tree)
    trainer = Trainer(cfg, comm, Path(run_dir))
    result = trainer.run()
    return {
        "losses": [s.loss.hex() for s in result.steps],
        "params": trainer.optimizer.params_snapshot().numpy().copy(),
        "activations": trainer.program.activation_peak,
        "table": summary.memory_table(result, cfg.zero.stage),
    }


@pytest.mark.parametrize(
    "world, layout",
    [(2, ["zero=stage1"]), (2, ["zero=stage3"]), (4, ["dist.tp=2", "zero=stage3"])],
    ids=["zero1", "zero3", "tp2-zero3"],
)
def test_blocks_checkpointing_is_bitwise_and_keeps_fewer_bytes(tmp_path, world, layout):
    plain, blocks = (
        run_ranks(
            _run,
            world,
            compose_tree(
                BASE + layout + [f"dist.world_size={world}", f"model.activation_checkpointing={mode}"]
            ),
            str(tmp_path / mode),
        )
        for mode in ("none", "blocks")
    )
    for a, b in zip(plain, blocks):
        assert a["losses"] == b["losses"]
        assert (a["params"] == b["params"]).all()
        # Two blocks' insides are no longer kept, only their inputs: well under half here.
        assert 0 < b["activations"] < a["activations"] / 2, (a["activations"], b["activations"])
        line = a["table"].splitlines()[-1]
        assert line.startswith("activation bytes kept for backward") and str(a["activations"]) in line
    for mode, ranks in (("none", plain), ("blocks", blocks)):
        steps = [r for r in map(json.loads, open(tmp_path / mode / "metrics.jsonl")) if r["type"] == "step"]
        assert steps[-1]["memory"]["activation_bytes"]["max"] == max(r["activations"] for r in ranks)


def test_the_meter_counts_each_saved_storage_once_and_no_parameters():
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    lin = torch.nn.Linear(8, 8)
    meter = ActivationMeter()
    with meter.measure(lin):
        y = lin(x)  # saves x (and the weight: not counted)
        z = (y * y).sum()  # saves y twice: one storage
    assert meter.peak == x.nbytes + y.nbytes
    z.backward()


def test_what_a_dropped_branch_saved_is_not_kept_for_the_backward():
    x = torch.randn(4, 8, requires_grad=True)
    lin = torch.nn.Linear(8, 8)
    meter = ActivationMeter()
    with meter.measure(lin):
        unused = x.exp()  # saves its output; nothing uses it, so its graph (and what it saved) goes
        del unused
        y = lin(x)  # saves x
    assert meter.peak == x.nbytes
    y.sum().backward()


def test_checkpointed_model_matches_in_isolation_including_dropout():
    tokens = torch.randint(0, 64, (2, 16))
    grads = []
    for mode in ("none", "blocks"):
        model = build_model(ModelConfig(dropout=0.2, activation_checkpointing=mode), seed=1)
        torch.manual_seed(5)
        model(tokens, tokens).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_an_unknown_mode_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"model.activation_checkpointing must be one of \['none', 'blocks'\]"
    ):
        RunConfig.from_dict({"model": {"activation_checkpointing": "layers"}})
