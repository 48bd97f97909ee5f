"""Wrong or inert settings are refused before any worker starts, in one line, leaving nothing:
a data key the chosen corpus never reads, a run directory given as the checkpoint to resume; under
torchrun the same line is what torchrun reports as the root cause."""

import pytest
from e2e import torchrun
from forkrun import run_script
from trainrun import compose_tree

from distlib.app.config.run import ConfigError, RunConfig


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data.path=mytext.txt"], "data.path='mytext.txt'"),
        (["data.cache_dir=/tmp/tokens"], "data.cache_dir='/tmp/tokens'"),
        (["data=text", "data.total_tokens=5000"], "data.total_tokens=5000"),
        (["data=text", "data.follow_prob=0.5"], "data.follow_prob=0.5"),
        (["data=text", "data.seed=3"], "data.seed=3"),
    ],
)
def test_a_data_key_the_corpus_never_reads_is_refused(overrides, key):
    with pytest.raises(ConfigError, match=f"^{key} has no effect with data.kind="):
        RunConfig.from_dict(compose_tree(overrides))


def test_the_same_keys_at_their_own_corpus_are_accepted():
    RunConfig.from_dict(compose_tree(["data.total_tokens=5000", "data.follow_prob=0.5", "data.seed=3"]))
    RunConfig.from_dict(compose_tree(["data=text", "data.cache_dir=/tmp/tokens"]))


def test_an_inert_key_is_one_line_and_the_start_leaves_nothing(tmp_path):
    # run from an empty directory with Hydra's default outputs/<date>/<time>: nothing may remain
    proc = run_script("train.py", "data.path=mytext.txt", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "config error: data.path='mytext.txt' has no effect with data.kind=synthetic: it is used by "
        "data=text; add data=text"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_run_directory_given_as_the_checkpoint_names_its_checkpoints_and_the_line(tmp_path):
    run = tmp_path / "run"
    for step in (2, 4):
        (run / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:08d}" / "manifest.json").write_text("{}")
    proc = run_script("train.py", f"checkpoint.resume={run}", f"hydra.run.dir={tmp_path / 'new'}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"config error: checkpoint.resume={run} is a run directory, not a checkpoint (it holds 2 "
        f"checkpoint(s): step_00000002 ... step_00000004); continue that run with checkpoint.resume=latest "
        f"hydra.run.dir={run}, or name one: checkpoint.resume={run / 'checkpoints' / 'step_00000004'}"
    ]
    assert not (tmp_path / "new").exists()
    missing = run_script(
        "train.py", f"checkpoint.resume={tmp_path / 'nope'}", f"hydra.run.dir={tmp_path / 'new'}"
    )
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [
        f"config error: checkpoint.resume={tmp_path / 'nope'} does not exist"
    ]


@pytest.mark.slow
def test_under_torchrun_the_users_error_is_the_root_cause(tmp_path):
    proc = torchrun(tmp_path / "run", "train.steps=-1", nproc=2, timeout=120)
    assert proc.returncode != 0
    root_cause = proc.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "traceback : config error: train.steps must be an integer >= 1, got -1" in root_cause, root_cause
    assert not (tmp_path / "run").exists()
