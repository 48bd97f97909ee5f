"""data=text: byte tokenizer, token file, deterministic batches, exact resume, validation loss."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from forkrun import run_script
from multiproc import run_ranks
from trainrun import compose_tree, train

from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.data import corpus, tokens
from distlib.app.data.batches import BatchPlan, GlobalBatches, HeldOut, split_heldout
from distlib.app.data.tokens import ByteTokenizer, DataError
from distlib.app.model.minigpt import build_model
from distlib.app.observe.summary import loss_table
from distlib.comm.group import Comm

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data" / "sample.txt"
SMALL = ["model.seq_len=16", "model.dim=32"]


@pytest.fixture
def sample(tmp_path) -> Path:
    """A private copy of the bundled sample, so token files land in tmp_path, not the repo."""
    path = tmp_path / "sample.txt"
    shutil.copy(SAMPLE, path)
    return path


# -- tokenizer and token file -----------------------------------------------------
def test_byte_tokenizer_round_trips_any_unicode():
    text = "Rank zero → “naïve” 漢字 🙂\n"
    ids = ByteTokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert ByteTokenizer.decode(ids) == text


def test_bundled_sample_is_what_the_generator_writes(tmp_path):
    out = tmp_path / "regenerated.txt"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_sample_text.py"), str(out)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert out.read_bytes() == SAMPLE.read_bytes()
    assert 50_000 <= len(out.read_bytes()) <= 200_000
    out.read_bytes().decode("utf-8")


def test_the_sample_as_jsonl_documents_is_its_introduction_and_chapters(tmp_path):
    """scripts/make_sample_text.py --jsonl (docs/models.md's documents): one {"text": ...} a line,
    the introduction then each numbered chapter, which joined are data/sample.txt."""
    out = tmp_path / "sample.jsonl"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_sample_text.py"), "--jsonl", str(out)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    texts = [r["text"] for r in records]
    assert all(list(r) == ["text"] for r in records) and len(texts) > 100
    assert "".join(texts) == SAMPLE.read_text(encoding="utf-8")
    assert [t.split(".", 1)[0] for t in texts[1:]] == [str(c) for c in range(1, len(texts))]


@pytest.mark.parametrize("vocab", [256, 1000])
def test_token_file_header_and_memmap(tmp_path, vocab):
    ids = np.random.default_rng(0).integers(0, vocab, size=1001)
    path = tmp_path / "t.tokens"
    tokens.write_token_file(path, ids, vocab, "ab" * 32)
    mapped, header = tokens.open_tokens(path)
    assert isinstance(mapped, np.memmap)
    assert (header.vocab_size, header.count, header.source_sha256) == (vocab, 1001, "ab" * 32)
    assert mapped.dtype == (np.uint8 if vocab <= 256 else np.dtype("<u2"))
    assert path.stat().st_size == tokens.HEADER_BYTES + 1001 * mapped.dtype.itemsize
    np.testing.assert_array_equal(np.asarray(mapped, dtype=np.int64), ids)


def test_truncated_token_file_is_refused(tmp_path):
    path = tmp_path / "t.tokens"
    tokens.write_token_file(path, np.arange(100) % 256, 256, "00" * 32)
    with open(path, "r+b") as f:
        f.truncate(tokens.HEADER_BYTES + 50)
    with pytest.raises(DataError, match="header promises"):
        tokens.open_tokens(path)


def test_token_file_is_reused_when_unchanged_and_rebuilt_when_changed(sample):
    target, sha, built = tokens.ensure_token_file(sample)
    assert built and target == sample.parent / "sample.txt.u8.tokens"
    mapped, header = tokens.open_tokens(target)
    assert bytes(mapped) == sample.read_bytes() and header.source_sha256 == sha
    before = target.stat()

    again, sha2, built2 = tokens.ensure_token_file(sample)
    assert (again, sha2, built2) == (target, sha, False)
    after = target.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), (
        "token file was rewritten"
    )

    sample.write_text(sample.read_text(encoding="utf-8") + "One more line.\n", encoding="utf-8")
    _, sha3, built3 = tokens.ensure_token_file(sample)
    assert built3 and sha3 != sha
    mapped, header = tokens.open_tokens(target)
    assert bytes(mapped) == sample.read_bytes() and header.source_sha256 == sha3

    # a damaged token file is rebuilt, not trusted
    with open(target, "r+b") as f:
        f.truncate(1000)
    assert tokens.ensure_token_file(sample)[2]
    assert bytes(tokens.open_tokens(target)[0]) == sample.read_bytes()


_BIG_TEXT = """
import json, resource, sys
from pathlib import Path
from distlib.app.data import tokens
source = Path(sys.argv[1])
with open(source, "wb") as f:  # 32 MB of text, written a block at a time
    for i in range(32):
        f.write((f"line {i} of the big text. " * 50000).encode()[: 1 << 20])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
path, sha, built = tokens.ensure_token_file(source)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grown_kb": grown, "built": built, "path": str(path)}))
"""


def test_a_large_text_is_tokenized_in_bounded_memory(tmp_path):
    """The byte-level token file is the text's bytes copied a block at a time: tokenizing 32 MB
    grows the peak memory by less than 16 MB (reading the text whole took 32 MB, and its copy
    as bytes as much again)."""
    source = tmp_path / "big.txt"
    done = subprocess.run(
        [sys.executable, "-c", _BIG_TEXT, str(source)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["built"] and got["grown_kb"] < 16 * 1024, got
    mapped, header = tokens.open_tokens(Path(got["path"]))
    assert header.count == source.stat().st_size == 32 << 20
    assert (
        mapped[:1000].tobytes() == source.read_bytes()[:1000]
        and mapped[-1000:].tobytes() == source.read_bytes()[-1000:]
    )


def test_cache_dir_keeps_the_token_file_elsewhere(sample, tmp_path):
    target, _, _ = tokens.ensure_token_file(sample, str(tmp_path / "cache"))
    assert target.parent == tmp_path / "cache" and target.exists()
    assert not (sample.parent / "sample.txt.u8.tokens").exists()


def _load_on_ranks(comm: Comm, source: str) -> tuple[bytes, str]:
    mapped, sha = tokens.load_text_tokens(source, None, comm)
    return bytes(mapped), sha


def test_rank0_builds_and_every_rank_reads_the_same_tokens(sample):
    results = run_ranks(_load_on_ranks, 3, str(sample))
    assert all(r == results[0] for r in results)
    assert results[0][0] == sample.read_bytes()


def _load_expect_error(comm: Comm, source: str) -> str:
    try:
        tokens.load_text_tokens(source, None, comm)
    except DataError as exc:
        return str(exc)
    return "no error"


def _load_with_cache(comm: Comm, source: str, cache: str) -> str:
    try:
        tokens.load_text_tokens(source, cache, comm)
    except DataError as exc:
        return str(exc)
    return "no error"


def test_bad_utf8_is_refused_on_every_rank(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine text\n" * 10 + b"\xff\xfe broken")
    messages = run_ranks(_load_expect_error, 2, str(bad))
    assert messages[0] == messages[1]
    assert "not UTF-8" in messages[0] and "byte 100" in messages[0]


# -- configuration and invalid input ------------------------------------------------
def _cfg(overrides: list[str]) -> RunConfig:
    return RunConfig.from_dict(compose_tree(overrides))


def test_data_text_sets_byte_vocab_and_refuses_another(sample):
    cfg = _cfg(["data=text", f"data.path={sample}"])
    assert cfg.model.vocab_size == 256 and cfg.data.kind == "text"
    assert "data.kind" in cfg.departures()  # invariant 1 is the capstone's: a warning on real text
    with pytest.raises(ConfigError, match="model.vocab_size=64"):
        _cfg(["data=text", f"data.path={sample}", "model.vocab_size=64"])
    with pytest.raises(ConfigError, match="data.val_fraction > 0"):
        _cfg(["train.eval_every=5"])


def test_default_config_is_unchanged_by_the_new_keys():
    cfg = _cfg([])
    assert (cfg.data.kind, cfg.data.val_fraction, cfg.train.eval_every) == ("synthetic", 0.0, 0)
    assert cfg.model.vocab_size == 64 and cfg.train.monotone_until_step == 20


@pytest.mark.parametrize(
    "case, expect",
    [
        ("missing", "does not exist"),
        ("empty", "is empty"),
        ("short", "needs model.seq_len + 1 = 17"),
        ("no_val", "fewer than one validation sequence"),
    ],
)
def test_invalid_text_input_gets_a_clear_error(tmp_path, case, expect):
    path = tmp_path / "in.txt"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "short":
        path.write_text("only ten b", encoding="utf-8")
    elif case == "no_val":
        path.write_text("x" * 100, encoding="utf-8")
    cfg = _cfg(["data=text", f"data.path={path}", "data.val_fraction=0.1"])
    with pytest.raises(DataError, match=re.escape(expect)):
        corpus.check_source(cfg)


@pytest.mark.slow
def test_train_py_refuses_a_missing_text_file_with_exit_2(tmp_path):
    proc = run_script(
        "train.py",
        "data=text",
        f"data.path={tmp_path / 'nope.txt'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"data.path {tmp_path / 'nope.txt'} does not exist" in proc.stderr


@pytest.mark.slow
def test_train_py_reports_invalid_utf8_once(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"some text " * 100 + b"\xc3(")
    proc = run_script(
        "train.py",
        "data=text",
        f"data.path={bad}",
        "dist.world_size=2",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "is not UTF-8 text" in line]
    assert lines == [f"error: data.path {bad} is not UTF-8 text: invalid continuation byte at byte 1000"], (
        proc.stderr
    )


# -- batches ---------------------------------------------------------------------
def test_text_batches_are_deterministic_and_independent_of_world_size(sample):
    mapped, _ = tokens.open_tokens(tokens.ensure_token_file(sample)[0])
    train_part, held = split_heldout(mapped, 0.1)
    assert len(train_part) + len(held) == len(mapped) and len(held) == int(len(mapped) * 0.1)
    one = GlobalBatches(train_part, 32, BatchPlan(8, 1, 1), seed=7)
    four = GlobalBatches(train_part, 32, BatchPlan(8, 4, 1), seed=7)
    for step in (0, 5, 1000):  # step 1000 wraps into a later epoch
        ((whole_x, whole_y),) = one.micro_batches(step, 0)
        parts = [four.micro_batches(step, r)[0] for r in range(4)]
        assert torch.equal(torch.cat([x for x, _ in parts]), whole_x)
        assert torch.equal(torch.cat([y for _, y in parts]), whole_y)
        assert torch.equal(whole_x[:, 1:], whole_y[:, :-1])
    # no training window reaches into the held-out tail
    assert one.num_windows * 32 + 1 <= len(train_part)


def test_heldout_windows_split_across_ranks_cover_each_window_once():
    held = np.arange(1000) % 256
    whole = HeldOut(held, 10, max_windows=50)
    assert whole.num_windows == 50
    everything = torch.cat([x for x, _ in whole.batches(0, 1, 7)])
    shared = torch.cat([x for r in range(3) for x, _ in whole.batches(r, 3, 7)])
    assert torch.equal(everything, shared)
    assert torch.equal(everything[:, 0], torch.arange(0, 500, 10) % 256)


# -- training on text ----------------------------------------------------------------
def test_exact_resume_on_text_is_bitwise(sample, tmp_path):
    common = [
        "data=text",
        f"data.path={sample}",
        *SMALL,
        "train.steps=8",
        "checkpoint.every_steps=4",
        "dist.world_size=2",
        "train.eval_every=4",
        "checkpoint.verify_resume=true",
    ]
    full = run_ranks(train, 2, compose_tree(common), str(tmp_path / "full"))
    assert full[0]["resume_ok"] is True
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000004"
    resumed = run_ranks(
        train, 2, compose_tree(common + [f"checkpoint.resume={ckpt}"]), str(tmp_path / "resumed")
    )
    assert sorted(resumed[0]["losses"]) == [5, 6, 7, 8]
    for step, bits in resumed[0]["losses"].items():
        assert bits == full[0]["losses"][step], f"step {step} differs after resume"
    assert resumed[0]["val"][8] == full[0]["val"][8]
    assert resumed[0]["params"].tobytes() == full[0]["params"].tobytes()
    saved = json.loads((ckpt / "manifest.json").read_text())
    assert saved["world_size"] == 2


def test_resume_refuses_a_changed_text_file(sample, tmp_path):
    common = [
        "data=text",
        f"data.path={sample}",
        *SMALL,
        "train.steps=2",
        "checkpoint.every_steps=2",
        "dist.world_size=2",
        "checkpoint.verify_resume=false",
    ]
    run_ranks(train, 2, compose_tree(common), str(tmp_path / "a"))
    sample.write_text(sample.read_text(encoding="utf-8").replace("rank", "Rank"), encoding="utf-8")
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000002"
    with pytest.raises(AssertionError, match="data source: checkpoint"):
        run_ranks(
            train,
            2,
            compose_tree(common + [f"checkpoint.resume={ckpt}", "train.steps=4"]),
            str(tmp_path / "b"),
        )


def test_validation_loss_falls_and_is_the_mean_over_all_heldout_windows(sample, tmp_path):
    overrides = [
        "data=text",
        f"data.path={sample}",
        *SMALL,
        "train.steps=30",
        "checkpoint.every_steps=0",
        "dist.world_size=2",
        "train.eval_every=10",
        "train.eval_windows=40",
        "optimizer.lr=0.005",
    ]
    tree = compose_tree(overrides)
    ranks = run_ranks(train, 2, tree, str(tmp_path / "run"))
    val = ranks[0]["val"]
    assert all(r["val"] == val for r in ranks), "ranks disagree on the validation loss"
    assert sorted(val) == [10, 20, 30]
    assert val[30] < val[10] < np.log(256), val

    # the same number from one process scoring every window with the final parameters
    cfg = RunConfig.from_dict(tree)
    model = build_model(cfg.model, 0).eval()
    torch.nn.utils.vector_to_parameters(torch.from_numpy(ranks[0]["params"]), model.parameters())
    held = HeldOut(
        split_heldout(tokens.open_tokens(sample.parent / "sample.txt.u8.tokens")[0], 0.1)[1], 16, 40
    )
    with torch.no_grad():
        losses = [float(model(x, y)) * y.numel() for x, y in held.batches(0, 1, 40)]
    assert val[30] == pytest.approx(sum(losses) / (40 * 16), rel=1e-6)  # float32 means of other groupings

    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "val_loss" in r] == [10, 20, 30]
    assert all(
        float.fromhex(r["val_loss_hex"]) == r["val_loss"] == val[r["step"]] for r in lines if "val_loss" in r
    )


def test_loss_table_shows_validation_only_when_evaluated():
    from distlib.app.observe.results import RunResult, StepLog

    plain = RunResult(0, [StepLog(1, 2.0, 0.5, [1.0], 0.01), StepLog(2, 1.5, 0.4, [1.0], 0.01)])
    assert "val loss" not in loss_table(plain)
    evaluated = RunResult(0, [StepLog(1, 2.0, 0.5, [1.0], 0.01), StepLog(2, 1.5, 0.4, [1.0], 0.01, 1.75)])
    table = loss_table(evaluated).splitlines()
    assert "val loss" in table[0] and "1.750000" in table[2] and "1.750000" not in table[1]


def test_unwritable_token_file_location_is_reported_on_every_rank(sample, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    messages = run_ranks(_load_with_cache, 2, str(sample), str(blocked / "cache"))
    assert messages[0] == messages[1] and "data.cache_dir" in messages[0] and "tokenizing" in messages[0]
