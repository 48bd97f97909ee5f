"""Nothing is loaded from a damaged or ill-fitting checkpoint: each defect is refused with a message
naming it, and the end-of-run resume check catches an RNG restore that does nothing."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_util import train, tree

from distlib.app.config.run import RunConfig
from distlib.app.trainer import Trainer
from distlib.checkpoint import rng_state
from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.sharded import CheckpointError
from distlib.comm.group import Comm


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A run directory with committed 2-rank checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("run")
    results = train(tree(2), run_dir)
    assert all(r["error"] is None for r in results)
    return run_dir / "checkpoints" / "step_00000006"


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    copy = tmp_path / "checkpoints" / pristine.name
    shutil.copytree(pristine, copy)
    return copy


def _entry(ckpt: Path, name: str) -> dict:
    return next(f for f in json.loads((ckpt / "manifest.json").read_text())["files"] if f["path"] == name)


def test_pristine_checkpoint_verifies(ckpt):
    manifest = checkpoint.verify(ckpt)
    assert [f["path"] for f in manifest["files"]] == ["rank00000.safetensors", "rank00001.safetensors"]
    for entry in manifest["files"]:
        assert hashlib.sha256((ckpt / entry["path"]).read_bytes()).hexdigest() == entry["sha256"]


def test_truncated_shard_is_refused_with_sizes(ckpt):
    shard, entry = ckpt / "rank00001.safetensors", _entry(ckpt, "rank00001.safetensors")
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError) as err:
        checkpoint.verify(ckpt)
    msg = str(err.value)
    assert str(ckpt) in msg and "rank00001.safetensors" in msg
    assert f"has {entry['bytes'] - 10} bytes" in msg and f"expected {entry['bytes']} bytes" in msg


def test_bit_flip_is_refused_with_both_digests(ckpt):
    shard, entry = ckpt / "rank00000.safetensors", _entry(ckpt, "rank00000.safetensors")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        checkpoint.verify(ckpt)
    msg = str(err.value)
    assert str(ckpt) in msg and "rank00000.safetensors" in msg
    assert hashlib.sha256(bytes(data)).hexdigest() in msg and entry["sha256"] in msg


def test_missing_shard_is_refused(ckpt):
    entry = _entry(ckpt, "rank00001.safetensors")
    (ckpt / "rank00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank00001.safetensors is missing") as err:
        checkpoint.verify(ckpt)
    assert entry["sha256"] in str(err.value) and str(ckpt) in str(err.value)


def test_extra_shard_is_refused(ckpt):
    shutil.copy(ckpt / "rank00001.safetensors", ckpt / "rank00002.safetensors")
    with pytest.raises(CheckpointError, match=r"not listed in the manifest: \['rank00002.safetensors'\]"):
        checkpoint.verify(ckpt)


@pytest.mark.parametrize("text", ["{not json", "\xff\xfe"])  # a malformed field: test_manifest_validation.py
def test_unparsable_manifest_is_refused(ckpt, text):
    manifest = ckpt / "manifest.json"
    manifest.write_bytes(text.encode("latin-1") if text == "\xff\xfe" else text.encode())
    with pytest.raises(CheckpointError, match="does not parse as a checkpoint manifest") as err:
        checkpoint.verify(ckpt)
    assert str(manifest) in str(err.value)


def test_uncommitted_directory_is_refused(ckpt):
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="never committed"):
        checkpoint.verify(ckpt)


def _fresh_trainer(tmp_path: Path, **groups) -> Trainer:
    (tmp_path / "run").mkdir(exist_ok=True)
    return Trainer(RunConfig.from_dict(tree(1, **groups)), Comm.world(), tmp_path / "run")


def test_damaged_checkpoint_loads_nothing(ckpt, tmp_path):
    shard = ckpt / "rank00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    trainer = _fresh_trainer(tmp_path, checkpoint={"resume": str(ckpt)})
    before = trainer.optimizer.params_snapshot(), trainer.optimizer.state_shard()
    with pytest.raises(CheckpointError, match="rank00001.safetensors has 100 bytes"):
        trainer.run()
    assert torch.equal(before[0], trainer.optimizer.params_snapshot())
    assert all(torch.equal(before[1][k], v) for k, v in trainer.optimizer.state_shard().items())


def test_loading_never_unpickles(ckpt, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint data must not go through pickle")

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    trainer = _fresh_trainer(tmp_path, checkpoint={"resume": str(ckpt)})
    assert trainer.checkpointer.loader.load(ckpt, trainer.model, trainer.optimizer) == 6


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            {"model": {"dim": 64}},
            [
                "model.dim: checkpoint 32, this run 64",
                "parameter tok_emb.weight: checkpoint 64x32, model 64x64",
                "parameter lm_head.weight: checkpoint 64x32, model 64x64",
            ],
        ),
        (
            {"model": {"n_layers": 3}},
            [
                "model.n_layers: checkpoint 2, this run 3",
                "parameter blocks.2.attn.qkv.weight: checkpoint absent, model 96x32",
            ],
        ),
        (
            {"train": {"global_batch": 8}},
            ["global batch: checkpoint 16 sequences per step, this run 8", "train.global_batch=16"],
        ),
        ({"data": {"seed": 5}}, ["data.seed: checkpoint 0, this run 5"]),
    ],
)
def test_mismatched_run_lists_every_difference_and_loads_nothing(ckpt, tmp_path, override, expected):
    trainer = _fresh_trainer(tmp_path, checkpoint={"resume": str(ckpt)}, **override)
    before = trainer.optimizer.params_snapshot()
    with pytest.raises(CheckpointError) as err:
        trainer.run()
    msg = str(err.value)
    assert "does not fit this run, nothing was loaded" in msg
    for line in expected:
        assert line in msg
    assert "lm_head.bias: checkpoint 64, model 64" not in msg  # unchanged shapes are not listed
    assert torch.equal(before, trainer.optimizer.params_snapshot())


# -- invariant 4's RNG half can fail -----------------------------------------------------------------
def test_resume_check_catches_an_rng_restore_that_does_nothing(tmp_path, monkeypatch):
    """Training draws nothing from the process RNGs (dropout's masks are keyed by sample), so after
    the run they still hold the saved states: a restore that does nothing must still be caught. The
    check re-seeds them first and compares what the restored generators draw with what the saved
    ones draw."""
    config = tree(1, steps=4, every=2, checkpoint={"verify_resume": True})
    (good,) = train(config, tmp_path / "good")
    assert good["resume_ok"] is True

    monkeypatch.setattr(rng_state, "restore_rng", lambda tensors, meta: None)
    trainer = Trainer(RunConfig.from_dict(config), Comm.world(), tmp_path / "broken")
    check = trainer.run().resume_check
    assert not check.ok
    for name in ("torch", "numpy", "python"):
        assert f"rank 0: {name} RNG draws differ after the restore" in check.mismatches


def test_resume_with_dropout_continues_the_same_random_draws(tmp_path):
    """With dropout every step draws masks: a resumed run matches the uninterrupted one bit for bit
    only if it draws the masks the uninterrupted run drew at those steps (keyed by the samples it
    reads: the data position must come back exactly)."""
    common = dict(steps=8, every=4, model={"dropout": 0.1})
    full = train(tree(2, **common, checkpoint={"verify_resume": True}), tmp_path / "full")
    resumed = train(
        tree(2, **common, checkpoint={"resume": str(tmp_path / "full/checkpoints/step_00000004")}),
        tmp_path / "resumed",
    )
    for rank in range(2):
        assert full[rank]["resume_ok"] is True
        assert resumed[rank]["start"] == 4
        assert [resumed[rank]["losses"][s] for s in range(5, 9)] == [
            full[rank]["losses"][s] for s in range(5, 9)
        ]
        assert (resumed[rank]["params"] == full[rank]["params"]).all()
    # dropout is on: the same run without it takes other steps
    plain = train(tree(2, steps=8, every=4), tmp_path / "plain")
    assert plain[0]["losses"][5] != full[0]["losses"][5]


def test_an_unreadable_shard_is_a_checkpoint_error_naming_the_file(tmp_path):
    """load_shard on a file safetensors cannot parse (its callers verify first; a reader that
    does not still gets one CheckpointError naming the file, not the parser's own exception)."""
    (tmp_path / checkpoint.shard_name(0)).write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=f"cannot read {checkpoint.shard_name(0)}: "):
        checkpoint.load_shard(tmp_path, 0)
