"""Every configuration key is checked before any worker starts, and the same checks read the run
configuration a checkpoint carries.

For every key of every group, a value of the wrong type and a value out of its range each end in
exactly one line, ``config error: <key> ...``, and exit status 2 (train.py's ``checked_config``,
which the command line goes through: a sample of keys is also run through the real ``train.py``).
A manifest whose model or data config is invalid is refused by ``scripts/ckpt.py verify`` and by
a resume, naming the key.
"""

from __future__ import annotations

import copy
import json
import shutil
import typing
from pathlib import Path

import pytest
from forkrun import run_script

import train
from distlib.app.config import schema
from distlib.app.config.run import GROUPS, RunConfig
from distlib.launch.hydra_config import compose_tree, defaults_tree

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "ckpt_v1_ws2_stage1_step10"

# Keys that take any string: nothing is out of range before the run uses them (and says so then).
FREE_FORM = {
    "checkpoint.dir": "any directory name (relative to the run directory, or absolute)",
    "checkpoint.resume": "a checkpoint path, checked when it is loaded (one error line naming it)",
    "data.cache_dir": "any directory, checked when the token file is written",
    "data.text_field": "a jsonl field name, checked on every document line",
    "dist.store": "HOST:PORT, checked with dist.nodes > 1, refused without (tests/test_hosts.py)",
    "fault.perturb_param": "a parameter name, checked when the model is built",
    "model.init_from": "a Hugging Face model directory, checked before a fresh run starts",
}
# Out-of-range values that need a specific value (or another key) to be out of range at all.
SPECIAL_RANGE = {
    "metrics.file": ("a/b.jsonl", {}),
    "data.path": ("/no/such/file.txt", {"data.kind": "text", "model.vocab_size": 256}),
    "data.tokenizer": ("/no/such/tokenizer", {"data.kind": "text", "data.path": "data/sample.txt"}),
}


def _all_keys() -> list[tuple[str, schema.Spec]]:
    keys = [(f"{group}.{spec.name}", spec) for group, cls in GROUPS.items() for spec in schema.specs(cls)]
    return keys + [(spec.name, spec) for spec in schema.specs(RunConfig)]


def _wrong_type(spec: schema.Spec):
    return 5 if spec.base is str else "maybe"  # a number for a string; a string for everything else


def _out_of_range(spec: schema.Spec):
    """A value of the key's own type that its rule refuses (None: the type alone is the rule)."""
    rule, base = spec.rule, spec.base
    if rule.choices is not None:
        return "no-such-choice" if base is str else max(rule.choices) + 1
    if base is int or base is float:
        step = 1 if base is int else 0.5
        if rule.ge is not None:
            return base(rule.ge - step)
        if rule.gt is not None:
            return base(rule.gt)
        if rule.le is not None:
            return base(rule.le + step)
        return base(rule.lt)
    if typing.get_origin(base) is tuple:
        return [0, 1]  # profile_steps: the first step is 1
    return None


def _cases() -> list[tuple[str, str, object, dict]]:
    cases = []
    for name, spec in _all_keys():
        cases.append((name, "wrong type", _wrong_type(spec), {}))
        if name in SPECIAL_RANGE:
            value, also = SPECIAL_RANGE[name]
            cases.append((name, "out of range", value, also))
        elif (bad := _out_of_range(spec)) is not None:
            cases.append((name, "out of range", bad, {}))
    return cases


def _with(tree: dict, settings: dict) -> dict:
    tree = copy.deepcopy(tree)
    for dotted, value in settings.items():
        *groups, name = dotted.split(".")
        node = tree
        for g in groups:
            node = node[g]
        node[name] = value
    return tree


def test_every_key_has_a_rule_or_is_named_free_form():
    """No key escapes the matrix below: each has a range (or choices), is a bool, or is listed."""
    unchecked = [
        name
        for name, spec in _all_keys()
        if spec.base is not bool and name not in SPECIAL_RANGE and _out_of_range(spec) is None
    ]
    assert sorted(unchecked) == sorted(FREE_FORM)


@pytest.mark.parametrize("name, what, value, also", _cases(), ids=lambda v: v if isinstance(v, str) else None)
def test_a_bad_value_of_any_key_is_one_config_error_line_and_exit_2(name, what, value, also, capsys):
    tree = _with(defaults_tree(), {**also, name: value})
    with pytest.raises(SystemExit) as exit_:
        train.checked_config(tree)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.startswith(f"config error: {name} "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_the_defaults_and_each_group_option_pass_the_same_checks():
    assert isinstance(train.checked_config(defaults_tree()), RunConfig)
    for choice in ("zero=stage0", "zero=stage2", "zero=stage3", "data=text"):
        assert isinstance(train.checked_config(compose_tree([choice])), RunConfig)


@pytest.fixture(scope="module")
def warm_hydra():
    """Hydra imported and conf/ composed once in this process: a forked train.py then starts at once."""
    compose_tree(["seed=1"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("seed=abc", "config error: seed must be an integer >= 0, got 'abc'"),
        ("model.vocab_size=1", "config error: model.vocab_size must be an integer >= 2, got 1"),
        ("optimizer.lr=fast", "config error: optimizer.lr must be a number > 0, got 'fast'"),
        ("zero.overlap=2", "config error: zero.overlap must be true or false, got 2"),
        (
            "dist.pp_schedule=zigzag",
            "config error: dist.pp_schedule must be one of ['gpipe', '1f1b', 'interleaved']",
        ),
        ("train.profile_steps=[0,3]", "config error: train.profile_steps must be [a, b] with 1 <= a <= b"),
        ("fault.kill_rank=-1", "config error: fault.kill_rank must be null or an integer >= 0, got -1"),
        ("checkpoint.dir=5", "config error: checkpoint.dir must be a string, got 5"),
    ],
)
def test_the_command_line_goes_through_the_same_check(override, message, warm_hydra, tmp_path):
    proc = run_script("train.py", override, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "run").exists()  # refused before the run wrote anything: nothing left


def _damaged_copy(tmp_path: Path, edit) -> Path:
    ckpt = tmp_path / "checkpoints" / FIXTURE.name
    shutil.copytree(FIXTURE, ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    edit(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["model"].update(dim=-1), "model.dim must be an integer >= 1, got -1"),
        (lambda m: m["model"].update(colour="red"), "unknown key(s) in config group 'model': ['colour']"),
        (
            lambda m: m["data_config"].update(follow_prob=2.0),
            "data.follow_prob must be a number >= 0 and <= 1, got 2.0",
        ),
    ],
)
def test_ckpt_verify_refuses_an_invalid_run_configuration_in_the_manifest(tmp_path, edit, message):
    ckpt = _damaged_copy(tmp_path, edit)
    proc = run_script("scripts/ckpt.py", "verify", str(ckpt))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        proc.stderr.startswith(
            f"error: checkpoint {ckpt}: the run configuration in its manifest is invalid: {message}"
        )
        and proc.stderr.count("\n") == 1
    ), proc.stderr
    assert run_script("scripts/ckpt.py", "verify", str(FIXTURE)).returncode == 0  # the original is fine


@pytest.mark.slow
def test_a_resume_refuses_an_invalid_run_configuration_in_the_manifest(tmp_path):
    ckpt = _damaged_copy(tmp_path, lambda m: m["model"].update(dim=-1))
    proc = run_script(
        "train.py",
        "dist.world_size=2",
        f"checkpoint.resume={ckpt}",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: checkpoint")]
    assert lines == [
        f"error: checkpoint {ckpt}: the run configuration in its manifest is invalid: "
        f"model.dim must be an integer >= 1, got -1"
    ], proc.stderr
    assert "Traceback" not in proc.stderr
