"""A malformed manifest is refused when it is read, with one line naming the field,
from the library, from every scripts/ckpt.py verb and from train.py's resume -- never a traceback,
a KeyError or a ZeroDivisionError from whichever reader indexes it first."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ckpt_util import train, tree
from forkrun import run_script

from distlib.app.config.run import DTYPES, RunConfig
from distlib.app.trainer import Trainer
from distlib.checkpoint import manifest as manifest_rules
from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.sharded import CheckpointError
from distlib.comm.group import Comm

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "ckpt.py"
_spec = importlib.util.spec_from_file_location("ckpt_tool", SCRIPT)
ckpt_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ckpt_tool)


def _set(*path, value) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        for key in path[:-1]:
            m = m[key]
        m[path[-1]] = value

    return edit


def _del(*path) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        for key in path[:-1]:
            m = m[key]
        del m[path[-1]]

    return edit


def _qkv(m: dict, t: int) -> dict:
    return next(p for p in m["tp_layouts"][t]["params"] if p["name"] == "blocks.0.attn.qkv.weight")


class Whole:
    """An edit's result that replaces the whole manifest (other edits change it in place)."""

    def __init__(self, value):
        self.value = value


# (id, edit of a sound 2-rank tp=1 manifest, the problem the error names)
CASES = [
    ("world_size_zero", _set("world_size", value=0), "world_size must be >= 1, got 0"),
    ("world_size_text", _set("world_size", value="2"), "world_size must be an integer, got '2'"),
    ("world_size_true", _set("world_size", value=True), "world_size must be an integer, got True"),
    ("no_step", _del("step"), 'manifest lacks "step"'),
    ("negative_step", _set("step", value=-1), "step must be >= 0, got -1"),
    ("only_format_version", lambda m: Whole({"format_version": 1}), 'manifest lacks "step"'),
    ("zero_stage_4", _set("zero_stage", value=4), "zero_stage must be one of [0, 1, 2, 3], got 4"),
    ("no_zero_stage", _del("zero_stage"), 'manifest lacks "zero_stage"'),
    ("no_model", _del("model"), 'manifest lacks "model"'),
    (
        "param_dtype",
        _set("param_dtype", value="fp8"),
        "param_dtype must be one of ['fp32', 'bf16'], got 'fp8'",
    ),
    ("tp_zero", _set("tp", value=0), "tp must be >= 1, got 0"),
    ("tp_not_dividing", _set("tp", value=3), "world_size 2 is not a multiple of tp 3"),
    ("dp_inconsistent", _set("dp", value=3), "dp 3 x tp 1 != world_size 2"),
    (
        "tp_without_layouts",
        lambda m: [d.update(tp=2, dp=1) for d in (m, m["parallel"])],
        'manifest lacks "tp_layouts"',
    ),
    ("parallel_disagrees", _set("parallel", "dp", value=4), "disagrees with world_size 2, tp 1, pp 1"),
    ("parallel_cp", _set("parallel", "cp", value=3), "parallel: dist.cp=3 must be >= 1 and divide"),
    ("parallel_ep", _set("parallel", "ep", value=3), "parallel: dist.ep=3 must divide the batch ranks"),
    ("parallel_ep_text", _set("parallel", "ep", value="2"), "parallel: dist.ep must be an integer >= 1"),
    (
        "parallel_other_order",
        _set("parallel", "order", value=["dp", "pp", "cp", "tp"]),
        "parallel: rank order",
    ),
    ("no_layout", _del("layout"), 'manifest lacks "layout"'),
    ("layout_not_object", _set("layout", value=[]), "layout must be an object, got []"),
    ("param_lacks_shape", _del("layout", "params", 3, "shape"), 'layout.params[3] lacks "shape"'),
    ("param_lacks_name", _del("layout", "params", 0, "name"), 'layout.params[0] lacks "name"'),
    (
        "param_not_object",
        _set("layout", "params", 3, value="x"),
        "layout.params[3] must be an object, got 'x'",
    ),
    (
        "param_bad_shape",
        _set("layout", "params", 1, "shape", value=[16, -32]),
        "layout.params[1].shape must be a list of sizes >= 0, got [16, -32]",
    ),
    (
        "param_offset",
        _set("layout", "params", 3, "offset", value=2593),
        "layout.params[3].offset is 2593, expected 2592 (parameters lie back to back)",
    ),
    (
        "param_numel",
        _set("layout", "params", 2, "numel", value=7),
        "layout.params[2].numel is 7, but its shape [32] holds 32",
    ),
    (
        "param_twice",
        lambda m: m["layout"]["params"][3].update(name=m["layout"]["params"][2]["name"]),
        "layout.params names a parameter twice",
    ),
    ("layout_numel", _set("layout", "numel", value=5), "layout.numel is 5, expected"),
    ("layout_world_size", _set("layout", "world_size", value=3), "layout.world_size is 3, expected 2"),
    ("layout_padding", _set("layout", "padding", value=1), "layout.padding is 1, expected 0"),
    (
        "layout_dtype",
        _set("layout", "dtype", value="float16"),
        "layout.dtype must be 'float32', got 'float16'",
    ),
    ("no_files", _del("files"), 'manifest lacks "files"'),
    ("file_missing", _del("files", 1), "files lists 1 file(s), expected one shard per rank (2)"),
    (
        "file_escapes",
        _set("files", 0, "path", value="../../elsewhere.safetensors"),
        "files[0].path is '../../elsewhere.safetensors', expected 'rank00000.safetensors'",
    ),
    ("files_swapped", lambda m: m["files"].reverse(), "files[0].path is 'rank00001.safetensors'"),
    ("file_rank", _set("files", 1, "rank", value=0), "files[1].rank is 0, expected 1"),
    ("file_bytes", _set("files", 0, "bytes", value=-1), "files[0].bytes must be >= 0, got -1"),
    (
        "file_sha256",
        _set("files", 1, "sha256", value="xyz"),
        "files[1].sha256 must be 64 lowercase hex digits",
    ),
    ("not_an_object", lambda m: Whole([m]), "a manifest is a JSON object, got [{"),
]

# The same for a 2-rank tp=2 manifest: one flat layout per tensor rank, each naming its split.
TP_CASES = [
    ("layouts_count", _del("tp_layouts", 1), "tp_layouts has 1 layout(s), expected one per tensor rank (2)"),
    ("no_layouts", _del("tp_layouts"), 'manifest lacks "tp_layouts"'),
    (
        "empty_layouts",
        _set("tp_layouts", value=[]),
        "tp_layouts has 0 layout(s), expected one per tensor rank (2)",
    ),
    ("split_index", lambda m: _qkv(m, 1)["split"].update(index=0), "does not fit tensor rank 1 of 2"),
    ("split_parts", lambda m: _qkv(m, 0)["split"].update(parts=4), "does not fit tensor rank 0 of 2"),
    ("split_dim", lambda m: _qkv(m, 0)["split"].update(dim=2), "does not fit tensor rank 0 of 2"),
    ("no_split", lambda m: _qkv(m, 0).pop("split") and None, 'lacks "split"'),
    (
        "full_shape",
        lambda m: _qkv(m, 1).update(full_shape=[24, 32]),
        "full_shape is [24, 32], expected [96, 32]",
    ),
    ("replicated_shape", lambda m: _qkv(m, 1).update(split=None), "replicated (split null) but shape"),
    ("dp_with_tp", _set("dp", value=2), "dp 2 x tp 2 != world_size 2"),
]


def _group(**change) -> Callable[[dict], None]:
    """Add a group holding (as an expert-parallel run writes: the experts one expert rank holds,
    partitioned over the ranks holding them) built from the dp run's layout, with ``change``."""

    def edit(m: dict) -> None:
        m["group_holdings"] = [
            {"prefix": "experts.", "tp_rank": 0, "layout": m["layout"], "files": [0, 1]} | change
        ]

    return edit


# A 2-rank manifest with the other parameter groups' holdings (group_holdings).
GROUP_CASES = [
    ("prefix", _group(prefix=""), "group_holdings[0].prefix must be a group name and a dot, got ''"),
    ("same_file", _group(files=[1, 1]), "group_holdings[0].files must be distinct ranks 0..1, got [1, 1]"),
    ("no_such_file", _group(files=[0, 2]), "group_holdings[0].files must be distinct ranks 0..1, got [0, 2]"),
    ("world", _group(files=[0]), "group_holdings[0].layout.world_size is 2, expected 1"),
    ("tp_rank", _group(tp_rank=-1), "group_holdings[0].tp_rank must be >= 0"),
    ("not_an_object", _set("group_holdings", value=[3]), "group_holdings[0] must be an object, got 3"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Sound checkpoints: a 2-rank one, and a 2-rank tensor-parallel (tp=2) one."""
    root = tmp_path_factory.mktemp("runs")
    assert all(r["error"] is None for r in train(tree(2, steps=3, every=3), root / "dp"))
    assert all(r["error"] is None for r in train(tree(2, steps=2, every=2, dist={"tp": 2}), root / "tp"))
    return {"dp": root / "dp/checkpoints/step_00000003", "tp": root / "tp/checkpoints/step_00000002"}


def _doctored(source: Path, tmp_path: Path, edit) -> Path:
    ckpt = tmp_path / "checkpoints" / source.name
    shutil.copytree(source, ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    new = edit(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(new.value if isinstance(new, Whole) else manifest))
    return ckpt


def test_sound_manifests_pass(runs):
    # each run saved once, after its last step: the dp run at step 3, the tp run at step 2
    assert checkpoint.verify(runs["dp"])["step"] == 3
    assert checkpoint.verify(runs["tp"])["step"] == 2
    assert json.loads((runs["tp"] / "manifest.json").read_text())["tp"] == 2


def test_param_dtypes_are_train_dtypes():
    assert set(manifest_rules.PARAM_DTYPES) == set(DTYPES)  # the checkpoint layer's copy of the list


@pytest.mark.parametrize("edit, problem", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_library_names_the_field(runs, tmp_path, edit, problem):
    ckpt = _doctored(runs["dp"], tmp_path, edit)
    for read in (checkpoint.read_manifest, checkpoint.verify):
        with pytest.raises(CheckpointError) as err:
            read(ckpt)
        assert str(err.value).startswith(f"checkpoint {ckpt / 'manifest.json'}: "), err.value
        assert problem in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("edit, problem", [c[1:] for c in TP_CASES], ids=[c[0] for c in TP_CASES])
def test_tensor_parallel_layouts_are_checked(runs, tmp_path, edit, problem):
    ckpt = _doctored(runs["tp"], tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"^checkpoint .*manifest\.json: ") as err:
        checkpoint.read_manifest(ckpt)
    assert problem in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("edit, problem", [c[1:] for c in GROUP_CASES], ids=[c[0] for c in GROUP_CASES])
def test_group_holdings_are_checked(runs, tmp_path, edit, problem):
    assert checkpoint.read_manifest(_doctored(runs["dp"], tmp_path / "sound", _group()))["group_holdings"]
    ckpt = _doctored(runs["dp"], tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"^checkpoint .*manifest\.json: ") as err:
        checkpoint.read_manifest(ckpt)
    assert problem in str(err.value) and "\n" not in str(err.value)


def _verbs(ckpt: Path, out: Path) -> list[list[str]]:
    return [
        ["inspect", str(ckpt)],
        ["verify", str(ckpt)],
        ["consolidate", str(ckpt), str(out / "c")],
        ["reshard", str(ckpt), str(out / "r"), "--world-size", "1"],
    ]


@pytest.mark.parametrize("edit, problem", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_ckpt_verb_prints_one_line(runs, tmp_path, capsys, edit, problem):
    ckpt = _doctored(runs["dp"], tmp_path, edit)
    for argv in _verbs(ckpt, tmp_path):
        assert ckpt_tool.main(argv) == 1, argv
        captured = capsys.readouterr()
        assert captured.err.startswith("error: checkpoint ") and captured.err.count("\n") == 1, (
            argv,
            captured,
        )
        assert problem in captured.err and captured.out == "", (argv, captured)
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()


def test_the_script_exits_with_one_line_not_a_traceback(runs, tmp_path):
    """world_size 0 passed `inspect` and `verify`, and `reshard` died in a traceback."""
    ckpt = _doctored(runs["dp"], tmp_path, _set("world_size", value=0))
    for argv in _verbs(ckpt, tmp_path):
        out = run_script(SCRIPT, *argv)
        assert out.returncode == 1, (argv, out.stdout, out.stderr)
        assert (
            out.stderr == f"error: checkpoint {ckpt / 'manifest.json'}: world_size must be >= 1, got 0\n"
        ), argv


@pytest.mark.parametrize(
    "case", ["world_size_zero", "param_lacks_shape", "file_escapes", "layout_world_size"]
)
def test_resume_refuses_and_loads_nothing(runs, tmp_path, case):
    _, edit, problem = next(c for c in CASES if c[0] == case)
    ckpt = _doctored(runs["dp"], tmp_path, edit)
    (tmp_path / "run").mkdir()
    trainer = Trainer(
        RunConfig.from_dict(tree(1, checkpoint={"resume": str(ckpt)})), Comm.world(), tmp_path / "run"
    )
    before = trainer.optimizer.params_snapshot()
    with pytest.raises(CheckpointError) as err:
        trainer.run()
    assert problem in str(err.value)
    assert torch.equal(before, trainer.optimizer.params_snapshot())


@pytest.mark.slow
def test_train_py_resume_prints_one_line(runs, tmp_path):
    ckpt = _doctored(runs["dp"], tmp_path, _set("world_size", value=0))
    proc = run_script(
        "train.py",
        f"hydra.run.dir={tmp_path / 'run'}",
        "dist.world_size=1",
        "train.steps=6",
        "train.global_batch=16",
        f"checkpoint.resume={ckpt}",
        timeout=300,
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: checkpoint")]
    assert lines == [f"error: checkpoint {ckpt / 'manifest.json'}: world_size must be >= 1, got 0"], (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_a_stale_dp_from_the_old_reshard_tool_is_still_read(runs, tmp_path):
    """scripts/ckpt.py reshard used to copy the source's dp; with tp == 1 nothing reads it."""
    ckpt = _doctored(
        runs["dp"], tmp_path, lambda m: m.update(dp=4, resharded_from={"path": "x", "world_size": 4})
    )
    assert checkpoint.verify(ckpt)["dp"] == 4


def test_a_newer_format_is_named_before_its_fields(runs, tmp_path):
    ckpt = _doctored(runs["dp"], tmp_path, lambda m: Whole({"format_version": 2}))
    with pytest.raises(CheckpointError, match=r"manifest\.json: format_version 2, this program reads 1$"):
        checkpoint.read_manifest(ckpt)
