"""Run-level extra files of a checkpoint (distlib/checkpoint/extra_files.py): rank 0 copies them in
before the commit, the manifest lists them with size and sha256, verification checks them like
the shards (the ranks share the hashing), a malformed ``extra_files`` entry is refused naming the
field, and a save without them writes the manifest it always wrote. The BPE run that uses them
is tests/test_bpe_run.py."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks

from distlib.checkpoint import extra_files
from distlib.checkpoint import manifest as manifest_rules
from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.sharded import CheckpointError

FIXTURE = Path(__file__).with_name("fixtures") / "ckpt_v1_ws2_stage1_step10"
# a real 2-rank run's manifest fields (model, layout, ...), so the saved manifests read as well-formed
META = {
    k: v
    for k, v in json.loads((FIXTURE / "manifest.json").read_text()).items()
    if k not in ("format_version", "step", "world_size", "files")
}


def _save(comm, root: str, extras: dict[str, str] | None, share: bool) -> dict:
    tensors = {"master": torch.full((4,), float(comm.rank))}
    path = checkpoint.save(Path(root), 3, tensors, {"step": 3}, META, comm, extras=extras)
    # each rank hashes its share of the files (the shards, then the extras), and all hear the verdict
    return checkpoint.verify_collectively(path, comm) if share else checkpoint.read_manifest(path)


def _sources(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.json").write_text('{"a": 1}\n')
    (tmp_path / "src" / "b.json").write_bytes(bytes(range(256)) * 40)
    return {
        "tok/deep/b.json": str(tmp_path / "src" / "b.json"),
        "tok/a.json": str(tmp_path / "src" / "a.json"),
    }


def test_extras_are_copied_listed_hashed_and_verified(tmp_path):
    sources = _sources(tmp_path)
    manifests = run_ranks(_save, 2, str(tmp_path / "ckpts"), sources, True)
    assert manifests[0] == manifests[1]
    ckpt = tmp_path / "ckpts" / "step_00000003"
    entries = manifests[0]["extra_files"]
    assert [e["path"] for e in entries] == ["tok/a.json", "tok/deep/b.json"]  # sorted
    for entry in entries:
        data = Path(sources[entry["path"]]).read_bytes()
        assert (ckpt / entry["path"]).read_bytes() == data
        assert (entry["bytes"], entry["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    assert list(manifests[0])[-2:] == ["files", "extra_files"]


def test_a_save_without_extras_writes_no_extra_key_and_verifies_as_before(tmp_path):
    manifest = run_ranks(_save, 2, str(tmp_path / "ckpts"), None, False)[0]
    assert list(manifest) == ["format_version", "step", "world_size", *META, "files"]
    ckpt = tmp_path / "ckpts" / "step_00000003"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "manifest.json",
        "rank00000.safetensors",
        "rank00001.safetensors",
    ]
    (ckpt / "stray").mkdir()  # an unlisted directory is named as before
    with pytest.raises(CheckpointError, match=r"not listed in the manifest: \['stray'\]"):
        checkpoint.verify(ckpt)


@pytest.fixture
def with_extras(tmp_path) -> Path:
    """A committed 2-rank checkpoint with two extra files (one in a subdirectory)."""
    run_ranks(_save, 2, str(tmp_path / "ckpts"), _sources(tmp_path), False)
    return tmp_path / "ckpts" / "step_00000003"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda c: (c / "tok/deep/b.json").write_bytes(b"x" * 10240), "tok/deep/b.json has sha256 "),
        (lambda c: (c / "tok/a.json").write_text("{}"), "tok/a.json has 2 bytes, expected 9 bytes"),
        (lambda c: (c / "tok/a.json").unlink(), "file tok/a.json is missing"),
        (
            lambda c: (c / "tok/deep/c.json").write_text("{}"),
            r"not listed in the manifest: ['tok/deep/c.json']",
        ),
        (lambda c: (c / "tok/more").mkdir(), r"not listed in the manifest: ['tok/more']"),
    ],
)
def test_a_damaged_extra_file_fails_verification_by_name(with_extras, damage, message):
    damage(with_extras)
    with pytest.raises(CheckpointError) as err:
        checkpoint.verify(with_extras)
    assert str(err.value).startswith(f"checkpoint {with_extras}: ") and message in str(err.value), err.value


def _entry(path: str, data: bytes = b"{}") -> dict:
    return {"path": path, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize(
    "extras, message",
    [
        ({"x": 1}, "extra_files must be a list"),
        ([[1]], "extra_files[0] must be an object"),
        ([{"bytes": 2, "sha256": "0" * 64}], 'extra_files[0] lacks "path"'),
        ([{**_entry("t.json"), "bytes": -1}], "extra_files[0].bytes must be >= 0"),
        ([{**_entry("t.json"), "sha256": "XYZ"}], "extra_files[0].sha256 must be 64 lowercase hex digits"),
        ([_entry("../outside.json")], "extra_files[0].path must be a relative path inside the checkpoint"),
        ([_entry("/etc/passwd")], "extra_files[0].path must be a relative path inside the checkpoint"),
        ([_entry("tok/.hidden")], "extra_files[0].path must be a relative path inside the checkpoint"),
        ([_entry("tok//a")], "extra_files[0].path must be a relative path inside the checkpoint"),
        (
            [_entry("a"), _entry("rank00001.safetensors")],
            "extra_files[1].path is 'rank00001.safetensors', a name",
        ),
        ([_entry("manifest.json")], "extra_files[0].path is 'manifest.json', a name the checkpoint uses"),
        ([_entry("a"), _entry("a")], "extra_files names a file twice"),
        ([_entry("t"), _entry("t/x")], "extra_files lists 't' as a file and as the directory of another"),
    ],
)
def test_a_malformed_extra_files_entry_is_refused_naming_the_field(tmp_path, extras, message):
    ckpt = tmp_path / FIXTURE.name
    shutil.copytree(FIXTURE, ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (ckpt / "manifest.json").write_text(json.dumps({**manifest, "extra_files": extras}))
    with pytest.raises(CheckpointError) as err:
        checkpoint.read_manifest(ckpt)
    assert message in str(err.value) and str(err.value).count("\n") == 0, err.value


def test_the_writer_refuses_a_name_the_checkpoint_uses_itself(tmp_path):
    source = tmp_path / "f"
    source.write_text("x")
    for name in ("manifest.json", "rank00000.safetensors", "../f", ".f"):
        with pytest.raises(manifest_rules.ManifestProblem):
            extra_files.write(tmp_path, {name: source}, {"manifest.json", "rank00000.safetensors"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # nothing was copied


def test_a_checkpoint_written_before_extra_files_existed_still_verifies():
    manifest = checkpoint.verify(FIXTURE)
    assert "extra_files" not in manifest and extra_files.listed(manifest) == []
