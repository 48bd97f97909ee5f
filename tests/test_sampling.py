"""scripts/sample.py and distlib/sampling.py: sharded and consolidated checkpoints on one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from forkrun import run_script
from multiproc import run_ranks
from trainrun import compose_tree, train

from distlib.app.checkpointing import sampling
from distlib.app.config.model_group import ModelConfig
from distlib.app.data.tokens import ByteTokenizer
from distlib.checkpoint import offline
from distlib.checkpoint.sharded import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "sample.py"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-rank ZeRO-1 text run (so the flat buffer is padded and split three ways) ending in a checkpoint."""
    tmp = tmp_path_factory.mktemp("sampling")
    text = tmp / "sample.txt"
    shutil.copy(ROOT / "data" / "sample.txt", text)
    tree = compose_tree(
        [
            "data=text",
            f"data.path={text}",
            "model.seq_len=16",
            "model.dim=24",
            "model.n_heads=3",
            "train.steps=6",
            "checkpoint.every_steps=6",
            "dist.world_size=3",
            "train.global_batch=12",
            "checkpoint.verify_resume=false",
        ]
    )
    ranks = run_ranks(train, 3, tree, str(tmp / "run"))
    ckpt = tmp / "run" / "checkpoints" / "step_00000006"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["layout"]["padding"] > 0, "choose a model whose size does not divide by 3"
    return ckpt, torch.from_numpy(ranks[0]["params"])


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_sharded_checkpoint_reassembles_the_trained_parameters(trained):
    ckpt, params = trained
    model = sampling.load_model(ckpt)
    assert not model.training
    assert torch.equal(_flat(model), params), "reassembled parameters differ from the trainer's"


@pytest.mark.slow
def test_a_damaged_shard_is_refused_before_loading(trained, tmp_path):
    ckpt, _ = trained
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    shard = copy / "rank00001.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[-5] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="rank00001.safetensors has sha256"):
        sampling.load_model(copy)
    proc = run_script(SCRIPT, str(copy), "--prompt", "Rank", "--tokens", "5")
    assert proc.returncode == 2 and "sha256" in proc.stderr and proc.stdout == ""


def test_greedy_generation_follows_the_models_argmax(trained):
    ckpt, _ = trained
    model = sampling.load_model(ckpt)
    prompt = ByteTokenizer.encode("The ring ")
    out = sampling.generate(model, prompt, 40, temperature=0)
    assert out[: len(prompt)] == prompt and len(out) == len(prompt) + 40
    # replay: each new token is the argmax of the logits on the (cropped) context before it
    for i in range(len(prompt), len(out)):
        context = torch.tensor([out[max(0, i - model.cfg.seq_len) : i]])
        assert out[i] == int(model(context)[0, -1].argmax())


def test_top_k_and_temperature_restrict_and_seed_the_draw(trained):
    ckpt, _ = trained
    model = sampling.load_model(ckpt)
    prompt = ByteTokenizer.encode("Every rank")

    def draw(seed, **kw):
        return sampling.generate(model, prompt, 30, generator=torch.Generator().manual_seed(seed), **kw)

    assert draw(1, temperature=1.0) == draw(1, temperature=1.0)
    assert draw(1, temperature=1.0) != draw(2, temperature=1.0)
    # top_k=1 is greedy whatever the temperature
    assert draw(3, temperature=5.0, top_k=1) == sampling.generate(model, prompt, 30, temperature=0)
    with pytest.raises(sampling.SampleError, match="empty"):
        sampling.generate(model, [], 3)
    with pytest.raises(sampling.SampleError, match="outside the model's vocabulary"):
        sampling.generate(model, [300], 3)


@pytest.mark.slow
def test_sample_cli_prints_prompt_and_continuation(trained):
    ckpt, _ = trained
    first = run_script(
        SCRIPT,
        str(ckpt),
        "--prompt",
        "Rank zero → ",
        "--tokens",
        "25",
        "--temperature",
        "0.8",
        "--top-k",
        "10",
        "--seed",
        "4",
    )
    assert first.returncode == 0, first.stderr
    model = sampling.load_model(ckpt)
    expected = sampling.generate(
        model, ByteTokenizer.encode("Rank zero → "), 25, 0.8, 10, torch.Generator().manual_seed(4)
    )
    assert first.stdout == ByteTokenizer.decode(expected) + "\n"
    assert first.stdout.startswith("Rank zero → ")


def test_consolidated_safetensors_gives_the_same_model(trained, tmp_path):
    ckpt, params = trained
    model = sampling.load_model(ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (with_meta,) = offline.consolidate(
        ckpt, tmp_path / "consolidated"
    )  # what scripts/ckpt.py consolidate writes
    again = sampling.load_model(with_meta)
    assert again.cfg == model.cfg and torch.equal(_flat(again), params)

    bare = tmp_path / "bare.safetensors"
    safetensors.torch.save_file(model.state_dict(), str(bare))
    with pytest.raises(sampling.SampleError, match="--n-heads"):
        sampling.load_model(bare)
    inferred = sampling.load_model(bare, n_heads=3)
    assert inferred.cfg == ModelConfig(**manifest["model"])
    context = torch.tensor([ByteTokenizer.encode("checkpoint")])
    assert torch.equal(inferred(context), model(context))


@pytest.mark.slow
def test_synthetic_vocabulary_samples_token_ids(tmp_path):
    tree = compose_tree(
        ["train.steps=2", "checkpoint.every_steps=2", "dist.world_size=2", "checkpoint.verify_resume=false"]
    )
    run_ranks(train, 2, tree, str(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    from_ids = run_script(SCRIPT, str(ckpt), "--prompt", "1 2 3", "--tokens", "4", "--temperature", "0")
    assert from_ids.returncode == 0, from_ids.stderr
    ids = [int(t) for t in from_ids.stdout.split()]
    assert ids[:3] == [1, 2, 3] and len(ids) == 7 and all(0 <= t < 64 for t in ids)
    from_text = run_script(SCRIPT, str(ckpt), "--prompt", "hello")
    assert from_text.returncode == 2 and "space-separated token ids" in from_text.stderr
