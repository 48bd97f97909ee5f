"""``checkpoint.resume=PATH`` in a new run directory takes from the checkpoint's manifest what the
command line leaves unset (distlib/app/checkpointing/manifest_config.py ``adopted``): the model's
config, the data keys of its tokenization, and the seed and global batch of its data order. What
the command line sets stays as set; ``latest`` (the run's own record) and an unreadable or invalid
manifest take nothing (the loader names those)."""

from __future__ import annotations

import json

import pytest

from distlib.app.checkpointing.manifest_config import adopted
from distlib.app.config.run import RunConfig
from distlib.launch.hydra_config import compose_tree

MODEL = {"family": "llama", "vocab_size": 300, "seq_len": 32, "dim": 64, "n_heads": 4, "n_layers": 2}
DATA = {"kind": "text", "path": "/elsewhere/corpus.jsonl", "tokenizer": "/tok", "text_field": "body"}


@pytest.fixture
def ckpt(tmp_path):
    manifest = {"model": MODEL, "data_config": DATA, "seed": 7, "data": {"global_batch": 8}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


def _tree(resume) -> dict:
    return {"model": {"family": "minigpt", "dim": 32}, "data": {"kind": "synthetic"}, "train": {},
            "checkpoint": {"resume": str(resume)}, "seed": 1234}  # fmt: skip


def test_what_the_command_line_leaves_unset_comes_from_the_manifest(ckpt):
    tree, taken = adopted(_tree(ckpt), {"model.dim"})
    assert tree["model"] == {**MODEL, "dim": 32}  # model.dim typed: kept
    assert tree["data"] == {"kind": "text", "tokenizer": "/tok", "text_field": "body"}  # not the path
    assert (tree["seed"], tree["train"]["global_batch"]) == (7, 8)
    assert taken == {f"model.{k}" for k in MODEL if k != "dim"} | {
        "data.kind", "data.tokenizer", "data.text_field", "seed", "train.global_batch"
    }  # fmt: skip
    tree, taken = adopted(_tree(ckpt), {"seed", "train.batch_size", "data.tokenizer"})
    assert tree["seed"] == 1234 and "global_batch" not in tree["train"] and "tokenizer" not in tree["data"]


@pytest.mark.parametrize("change", ["latest", "missing", "invalid"])
def test_nothing_is_taken_from_latest_an_unreadable_or_an_invalid_manifest(ckpt, change):
    if change == "invalid":  # the loader names it, with the checkpoint
        (ckpt / "manifest.json").write_text(json.dumps({"model": {**MODEL, "dim": -1}}))
    resume = {"latest": "latest", "missing": ckpt / "nowhere", "invalid": ckpt}[change]
    assert adopted(_tree(resume), set()) == (_tree(resume), set())


def test_the_launcher_adopts_before_the_configuration_is_checked(ckpt):
    (ckpt / "manifest.json").write_text(json.dumps({"model": MODEL, "seed": 7}))
    cfg = RunConfig.from_dict(compose_tree([f"checkpoint.resume={ckpt}"]))
    assert (cfg.model.family, cfg.model.dim, cfg.seed) == ("llama", 64, 7)
