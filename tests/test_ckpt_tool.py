"""scripts/ckpt.py: inspect prints a manifest, verify's exit status tells a sound checkpoint from a
damaged one, consolidate and reshard write loadable outputs and never overwrite or write into a checkpoint."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from ckpt_util import train, tree
from forkrun import run_script

from distlib.app.config.model_group import ModelConfig
from distlib.app.data.batches import make_corpus
from distlib.app.model.minigpt import MiniGPT
from distlib.checkpoint import offline
from distlib.checkpoint import sharded as checkpoint

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "ckpt.py"
_spec = importlib.util.spec_from_file_location("ckpt_tool", SCRIPT)
ckpt_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ckpt_tool)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    train(tree(4, steps=6, every=6), run)
    return run / "checkpoints" / "step_00000006"


def test_help_lists_every_command():
    out = run_script(SCRIPT, "--help")
    assert out.returncode == 0, out.stderr
    for command in ("inspect", "verify", "consolidate", "reshard"):
        assert command in out.stdout


def test_inspect_prints_the_manifest_readably(ckpt, capsys):
    assert ckpt_tool.main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    manifest = checkpoint.read_manifest(ckpt)
    assert "step 6, world size 4, ZeRO stage 1" in out
    for p in manifest["layout"]["params"]:
        assert f"{'x'.join(map(str, p['shape']))}" in out and p["name"] in out
    for f in manifest["files"]:
        assert f"{f['path']}" in out and str(f["bytes"]) in out
    assert f"total: {manifest['layout']['numel']} parameters" in out


def test_verify_exit_status_tells(ckpt, tmp_path):
    assert ckpt_tool.main(["verify", str(ckpt)]) == 0
    damaged = tmp_path / ckpt.name
    shutil.copytree(ckpt, damaged)
    shard = damaged / "rank00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x80
    shard.write_bytes(bytes(data))
    out = run_script(SCRIPT, "verify", str(damaged))
    assert out.returncode == 1
    assert out.stderr.startswith("error: checkpoint") and "rank00002.safetensors has sha256" in out.stderr
    assert "Traceback" not in out.stderr


def test_consolidated_weights_load_into_a_plain_minigpt(ckpt, tmp_path):
    assert ckpt_tool.main(["consolidate", str(ckpt), str(tmp_path / "out"), "--optimizer"]) == 0
    manifest = checkpoint.verify(ckpt)
    full = offline.full_state(ckpt, manifest)

    model = MiniGPT(ModelConfig(**manifest["model"]))  # no process group, no distlib training code
    weights = safetensors.torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    model.load_state_dict(weights)  # strict: every name and shape must match
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(flat, full["master"])
    assert all(t.dtype == torch.float32 for t in weights.values())

    optim = safetensors.torch.load_file(str(tmp_path / "out" / "optimizer.safetensors"))
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(
            torch.cat([optim[f"{key}.{name}"].reshape(-1) for name, _ in model.named_parameters()]), full[key]
        )

    # And it is a working model: its loss on corpus text is well below ln(vocab) of an untrained one.
    tokens = torch.from_numpy(make_corpus(0, 17 * 8)).view(8, 17)
    with torch.no_grad():
        loss = float(model(tokens[:, :-1], tokens[:, 1:]))
    assert loss < 0.9 * np.log(manifest["model"]["vocab_size"])


def test_reshard_command_writes_a_valid_checkpoint(ckpt, tmp_path, capsys):
    out = tmp_path / "step_00000006"
    assert ckpt_tool.main(["reshard", str(ckpt), str(out), "--world-size", "3"]) == 0
    assert "for 3 rank(s), verified" in capsys.readouterr().out
    manifest = checkpoint.verify(out)
    assert manifest["world_size"] == 3 and manifest["dp"] == 3 and len(manifest["files"]) == 3
    before = offline.full_state(ckpt, checkpoint.read_manifest(ckpt))
    after = offline.full_state(out, manifest)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert ckpt_tool.main(["reshard", str(ckpt), str(out), "--world-size", "2"]) == 1  # never overwrites
    assert "refusing to overwrite" in capsys.readouterr().err


def _tree_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"" for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("verb", ["consolidate", "reshard"])
@pytest.mark.parametrize(
    "where",
    ["existing_dir", "existing_file", "the_checkpoint", "inside_checkpoint", "deep_inside_checkpoint"],
)
def test_outputs_never_overwrite_nor_land_in_a_checkpoint(ckpt, tmp_path, capsys, verb, where):
    """consolidate / reshard refuse an existing OUT, and an OUT inside a checkpoint
    directory (an extra file there makes that checkpoint fail verification), writing nothing."""
    source = tmp_path / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, source)
    out = {
        "existing_dir": tmp_path / "out",
        "existing_file": tmp_path / "out.safetensors",
        "the_checkpoint": source,
        "inside_checkpoint": source / "export",
        "deep_inside_checkpoint": source / "a" / "b",
    }[where]
    if where == "existing_dir":
        out.mkdir()
    elif where == "existing_file":
        out.write_bytes(b"keep me")
    before = _tree_of(tmp_path)
    argv = [verb, str(source), str(out)] + (["--world-size", "2"] if verb == "reshard" else [])
    assert ckpt_tool.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: refusing to "), err
    assert (
        f"inside checkpoint {source}" in err if "inside" in where else "refusing to overwrite existing" in err
    )
    assert _tree_of(tmp_path) == before  # nothing written, not even a .partial directory
    checkpoint.verify(source)


def test_refused_output_exits_nonzero_with_one_line(ckpt, tmp_path):
    source = tmp_path / ckpt.name  # a copy: a broken refusal must not damage the shared one
    shutil.copytree(ckpt, source)
    out = run_script(SCRIPT, "consolidate", str(source), str(source / "export"))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (
        f"error: refusing to write {source / 'export'} inside checkpoint {source}: a file its "
        f"manifest does not list would fail its verification; write it elsewhere\n"
    )
    checkpoint.verify(source)
