"""A data.tokenizer=bpe run end to end: it learns, every checkpoint carries its tokenizer as listed,
hashed files, a resume continues bitwise (its async saves carry the tokenizer too) and refuses
another tokenizer by name, scripts/sample.py speaks text through the checkpoint's own copy, and
scripts/ckpt.py reshard / consolidate take the tokenizer along. A byte-level checkpoint is
unchanged: no extra file, no new manifest key."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from forkrun import run_script
from multiproc import run_ranks
from trainrun import compose_tree, train

from distlib.app.data import bpe
from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.sharded import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data" / "sample.txt"
FIXTURE = ROOT / "tests" / "fixtures" / "ckpt_v1_ws2_stage1_step10"
TOKENIZER = [
    "tokenizer/special_tokens_map.json",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
]
STEP3, STEP6 = "checkpoints/step_00000003", "checkpoints/step_00000006"


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _common(root: Path) -> list[str]:
    return [
        "data=text",
        f"data.path={SAMPLE}",
        f"data.cache_dir={root / 'cache'}",
        "data.tokenizer=bpe",
        "data.vocab_size=512",  # the model's vocabulary follows it
        "model.seq_len=32",
        "model.dim=32",
        "train.steps=6",
        "checkpoint.every_steps=3",
        "train.eval_every=3",
        "train.eval_windows=16",
        "dist.world_size=2",
        "checkpoint.verify_resume=false",
        "metrics.progress_every=0",
    ]


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> tuple[Path, dict]:
    """(run directory, rank 0's results) of a 6-step 2-rank BPE run with checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("bpe")
    out = run_ranks(train, 2, compose_tree(_common(root)), str(root / "full"))
    return root / "full", out[0]


def _manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def test_the_run_learns_and_every_checkpoint_carries_its_tokenizer(full):
    run, out = full
    losses = {step: float.fromhex(bits) for step, bits in out["losses"].items()}
    assert losses[6] < losses[1] < np.log(512) + 0.5, losses
    saved = run / "tokenizer"
    assert sorted(f"tokenizer/{p.name}" for p in saved.iterdir()) == TOKENIZER
    for step_dir in (STEP3, STEP6):
        ckpt = run / step_dir
        manifest = checkpoint.verify(ckpt)  # the extra files are checked like the shards
        assert [e["path"] for e in manifest["extra_files"]] == TOKENIZER
        for entry in manifest["extra_files"]:
            copy, original = ckpt / entry["path"], run / entry["path"]
            assert copy.read_bytes() == original.read_bytes()
            assert (entry["bytes"], entry["sha256"]) == (copy.stat().st_size, _sha(copy))
        source = manifest["data"]["source"]
        assert source == {
            "kind": "text",
            "sha256": _sha(SAMPLE),
            "tokenizer": "bpe",
            "tokenizer_sha256": _sha(ckpt / "tokenizer" / "tokenizer.json"),
        }
        assert (manifest["data_config"]["tokenizer"], manifest["data_config"]["vocab_size"]) == ("bpe", 512)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda c: (c / "tokenizer/tokenizer.json").write_text("{}"), "tokenizer/tokenizer.json has 2 bytes"),
        (lambda c: _flip(c / "tokenizer/tokenizer_config.json"), "(its contents changed)"),
        (lambda c: (c / "tokenizer/special_tokens_map.json").unlink(), "special_tokens_map.json is missing"),
        (
            lambda c: (c / "tokenizer/notes.txt").write_text("x"),
            "not listed in the manifest: ['tokenizer/notes.txt']",
        ),
    ],
)
def test_a_damaged_tokenizer_copy_fails_verification(full, tmp_path, damage, message):
    ckpt = tmp_path / "step_00000006"
    shutil.copytree(full[0] / STEP6, ckpt)
    damage(ckpt)
    with pytest.raises(CheckpointError, match=f"checkpoint {ckpt}: .*") as err:
        checkpoint.verify(ckpt)
    assert message in str(err.value)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_resume_is_bitwise_and_an_async_save_carries_the_tokenizer(full, tmp_path):
    run, out = full
    tree = compose_tree(
        _common(run.parent) + [f"checkpoint.resume={run / STEP3}", "checkpoint.async_save=true"]
    )
    resumed = run_ranks(train, 2, tree, str(tmp_path / "resumed"))[0]
    assert sorted(resumed["losses"]) == [4, 5, 6]
    for step, bits in resumed["losses"].items():
        assert bits == out["losses"][step], f"step {step} differs after resume"
    assert resumed["val"][6] == out["val"][6]
    assert resumed["params"].tobytes() == out["params"].tobytes()
    again = tmp_path / "resumed" / STEP6
    assert _manifest(again)["extra_files"] == _manifest(run / STEP6)["extra_files"]
    checkpoint.verify(again)


def test_resume_with_another_tokenizer_is_refused_naming_the_tokenizer(full, tmp_path, monkeypatch):
    run, _ = full
    trained = bpe.train_tokenizer
    # The same text and vocabulary size, but a tokenizer trained on other text: only it differs.
    monkeypatch.setattr(bpe, "train_tokenizer", lambda texts, n: trained([*texts, "zebra " * 500], n))
    other = _common(tmp_path) + [f"checkpoint.resume={run / STEP3}"]  # a fresh cache in tmp_path
    with pytest.raises(AssertionError) as err:
        run_ranks(train, 2, compose_tree(other), str(tmp_path / "other"))
    theirs = _manifest(run / STEP3)["data"]["source"]["tokenizer_sha256"]
    ours = _sha(tmp_path / "other" / "tokenizer" / "tokenizer.json")
    assert ours != theirs
    assert (
        f"(the tokenizer differs: checkpoint bpe with tokenizer.json sha256 {theirs}, this run bpe with "
        f"tokenizer.json sha256 {ours})" in str(err.value)
    )
    assert "content changed" not in str(err.value)


def test_sample_speaks_text_through_the_checkpoint_copy_of_the_tokenizer(full, tmp_path):
    ckpt = tmp_path / "alone" / "step_00000006"  # no run directory around it
    shutil.copytree(full[0] / STEP6, ckpt)
    proc = run_script(
        "scripts/sample.py", str(ckpt), "--prompt", "Rank zero", "--tokens", "8", "--temperature", "0"
    )
    assert proc.returncode == 0, proc.stderr
    tokenizer = bpe.load_tokenizer(ckpt / "tokenizer")
    assert proc.stdout.startswith("Rank zero") and len(tokenizer.encode(proc.stdout.rstrip("\n"))) > 2
    copy = ckpt / "tokenizer" / "tokenizer.json"
    recorded = _sha(copy)
    copy.write_text(copy.read_text() + " ")
    proc = run_script("scripts/sample.py", str(ckpt), "--prompt", "Rank zero", "--tokens", "8")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: checkpoint {ckpt}: file tokenizer/tokenizer.json has ")
    # listed with its new size and hash the copy verifies, but it is not the tokenizer the run used
    manifest = _manifest(ckpt)
    entry = next(e for e in manifest["extra_files"] if e["path"] == "tokenizer/tokenizer.json")
    entry.update(bytes=copy.stat().st_size, sha256=_sha(copy))
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    proc = run_script("scripts/sample.py", str(ckpt), "--prompt", "Rank zero", "--tokens", "8")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    expected = f"has sha256 {_sha(copy)}, but the run was trained with the tokenizer of sha256 {recorded}"
    assert expected in proc.stderr, proc.stderr


def test_reshard_and_consolidate_carry_the_tokenizer(full, tmp_path):
    ckpt = full[0] / STEP6
    proc = run_script("scripts/ckpt.py", "inspect", str(ckpt))
    listed = {e["path"]: e for e in _manifest(ckpt)["extra_files"]}["tokenizer/tokenizer.json"]
    row = f"  tokenizer/tokenizer.json  {listed['bytes']:>8}  {listed['sha256']}"
    assert proc.returncode == 0 and row in proc.stdout.splitlines(), proc.stdout
    one = tmp_path / "ws1"
    proc = run_script("scripts/ckpt.py", "reshard", str(ckpt), str(one), "--world-size", "1")
    assert proc.returncode == 0, proc.stderr
    assert _manifest(one)["extra_files"] == _manifest(ckpt)["extra_files"]
    assert all((one / name).read_bytes() == (ckpt / name).read_bytes() for name in TOKENIZER)
    proc = run_script("scripts/ckpt.py", "verify", str(one))
    assert proc.returncode == 0 and "4 file(s)" in proc.stdout, proc.stdout  # a shard and the tokenizer
    flat = tmp_path / "flat"
    proc = run_script("scripts/ckpt.py", "consolidate", str(ckpt), str(flat))
    assert proc.returncode == 0, proc.stderr
    assert all((flat / name).read_bytes() == (ckpt / name).read_bytes() for name in TOKENIZER)
    proc = run_script(
        "scripts/sample.py", str(flat / "model.safetensors"), "--prompt", "Rank zero", "--tokens", "4"
    )
    assert proc.returncode == 0 and proc.stdout.startswith("Rank zero"), proc.stderr


def test_a_byte_level_checkpoint_has_no_extra_file_and_no_new_manifest_key(tmp_path):
    tree = compose_tree(
        [
            "data=text",
            f"data.path={SAMPLE}",
            f"data.cache_dir={tmp_path}",
            "model.seq_len=16",
            "train.steps=1",
        ]
        + ["checkpoint.every_steps=1", "dist.world_size=2", "checkpoint.verify_resume=false"]
    )
    run_ranks(train, 2, tree, str(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    manifest, old = _manifest(ckpt), _manifest(FIXTURE)  # the fixture: written before extra files existed
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "manifest.json",
        "rank00000.safetensors",
        "rank00001.safetensors",
    ]
    # the same keys as the fixture's, but for the rank order, now recorded by name (distlib/comm/layout.py)
    renamed = ["parallel" if key == "rank_order" else key for key in old]
    assert list(manifest) == renamed and list(manifest["data_config"]) == list(old["data_config"])
    assert manifest["data"]["source"] == {"kind": "text", "sha256": _sha(SAMPLE)}


def test_an_exported_llama_carries_its_tokenizer_and_transformers_speaks_it(tmp_path):
    """scripts/export_hf.py of a BPE-trained Llama: the HF directory holds the checkpoint's own
    tokenizer files, AutoTokenizer encodes like our tokenizer does, and a tampered copy is refused."""
    import transformers

    from distlib.app.checkpointing import hf_export
    from distlib.app.model.hf_config import HFError

    args = [a for a in _common(tmp_path) if not a.startswith(("train.steps", "checkpoint.every_steps"))]
    tree = compose_tree(
        [*args, "model=llama", "model.n_kv_heads=2", "train.steps=3", "checkpoint.every_steps=3"]
    )
    run_ranks(train, 2, tree, str(tmp_path / "run"))
    ckpt = tmp_path / "run" / STEP3
    exported = hf_export.export(ckpt, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(exported.files)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (
        ckpt / "tokenizer" / "tokenizer.json"
    ).read_bytes()
    ours = bpe.load_tokenizer(ckpt / "tokenizer")
    text = "Rank zero saves the manifest last."
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs(text)["input_ids"] == ours.encode(text)
    copy = tmp_path / "copy" / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, copy)
    with pytest.raises(HFError, match="has sha256 .* not the run's tokenizer"):
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest["data"]["source"]["tokenizer_sha256"] = "0" * 64  # the run names another tokenizer
        (copy / "manifest.json").write_text(json.dumps(manifest))
        hf_export.export(copy, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
