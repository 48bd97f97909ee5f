"""A transformers model keeps training on its own tokenizer's ids (issue 39 items 1-2).

The test builds what a new user has: a Llama saved by transformers' save_pretrained with its
tokenizer (a byte-level BPE whose post-processor puts <s> first, saved by
PreTrainedTokenizerFast: tokenizer.json and tokenizer_config.json naming </s> as eos), and a jsonl
corpus. `train.py model.init_from=DIR data=text data.path=corpus.jsonl` alone then encodes every
document with that tokenizer, each ending with </s> -- the token file holds exactly what
transformers' own tokenizer gives -- and step 1's loss is transformers' loss on that batch within
1e-5. The checkpoint carries the tokenizer, the export is a directory transformers loads with the
same tokenizer, a continuation with another tokenizer is refused, and the same command line resumes
the checkpoint in a new directory at another layout. Bad input (a jsonl line that
is not JSON or lacks the field, a tokenizer with no end-of-text token, a model vocabulary smaller
than the tokenizer's ids, a path that does not exist) is one line.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from e2e import train as train_py
from family_models import perturb_, quiet_transformers
from forkrun import run_script
from trainrun import compose_tree

from distlib.app.config.data_group import DataConfig
from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.data import documents, pretrained, text_source, token_shards
from distlib.app.data.batches import BatchPlan, GlobalBatches
from distlib.app.data.corpus import check_source
from distlib.app.data.mixture import MixedBatches, SourceWindows
from distlib.app.data.tokens import DataError

pytestmark = pytest.mark.slow
transformers = quiet_transformers()
tokenizers = pytest.importorskip("tokenizers", reason="needs the `hf` extra (tokenizers)")

WORDS = "the a cat dog sat ran on under mat log big small red blue and then it was".split()
SEQ = 32


def _documents(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) + "." for _ in range(n)]


def _tokenizer(texts: list[str]):
    """A byte-level BPE with <s> (put first by its post-processor, as Llama's) and </s>."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict:
    """A saved Llama with its tokenizer, and a jsonl corpus (one blank line among the documents)."""
    root = tmp_path_factory.mktemp("user")
    docs = _documents(80, 0)
    tokenizer = _tokenizer(_documents(200, 1))
    tokenizer.save_pretrained(root / "llama")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer) + 4,  # a model may have more rows than the tokenizer has ids
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = transformers.AutoModelForCausalLM.from_config(config)
    perturb_(model, 3).save_pretrained(root / "llama")
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)]
    (root / "corpus.jsonl").write_text("\n".join(lines[:40] + [""] + lines[40:]) + "\n")
    return {"dir": root / "llama", "corpus": root / "corpus.jsonl", "docs": docs, "tokenizer": tokenizer}


def _expected_ids(user: dict) -> list[int]:
    """transformers' tokenizer on each document (its <s> first), then </s>."""
    tok = user["tokenizer"]
    return [i for d in user["docs"] for i in tok(d)["input_ids"] + [tok.eos_token_id]]


def test_init_from_alone_trains_on_the_directorys_tokenizer_and_exports_it(user, tmp_path):
    run = tmp_path / "run"
    args = [f"model.init_from={user['dir']}", "data=text", f"data.path={user['corpus']}"]
    args += [f"data.cache_dir={tmp_path / 'cache'}", "dist.world_size=1", "train.steps=2"]
    proc = train_py(run, *args, "checkpoint.every_steps=2", "metrics.progress_every=0")
    assert proc.returncode == 0, proc.stderr
    assert f"data.tokenizer: {user['dir'] / 'tokenizer.json'}" in proc.stdout  # one line says which
    # the token file is transformers' tokenization, document by document, the last ones held out
    cfg = RunConfig.from_dict(compose_tree(args))
    held = documents.held_out_count([len(d.encode()) for d in user["docs"]], cfg.data.val_fraction)
    train_ids = _expected_ids({**user, "docs": user["docs"][: len(user["docs"]) - held]})
    (cached,) = (tmp_path / "cache").glob("*.shards")
    cache = token_shards.Cache(cached, json.loads((cached / "index.json").read_text()))
    assert cache.tokens().tolist() == _expected_ids(user) and cache.val_start == len(train_ids) and held > 0
    # step 1's loss is transformers' on the same ids
    plan = BatchPlan(cfg.global_batch, 1, 1)
    ((x, y),) = GlobalBatches(np.asarray(train_ids), SEQ, plan, cfg.seed).step_batches(1, 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(user["dir"], attn_implementation="eager")
    with torch.no_grad():
        want = float(model.eval()(input_ids=x, labels=y.contiguous(), shift_labels=y.contiguous()).loss)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(float.fromhex(r["loss_hex"]) for r in records if r.get("type") == "step" and r["step"] == 1)
    assert abs(first - want) <= 1e-5, (first, want)
    # the checkpoint carries the tokenizer; the export is a transformers directory with it
    ckpt = run / "checkpoints" / "step_00000002"
    assert (ckpt / "tokenizer" / "tokenizer.json").read_bytes() == (
        user["dir"] / "tokenizer.json"
    ).read_bytes()
    out = tmp_path / "export"
    proc = run_script("scripts/export_hf.py", str(ckpt), str(out))
    assert proc.returncode == 0, proc.stderr
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert [exported(d)["input_ids"] for d in user["docs"][:5]] == [
        user["tokenizer"](d)["input_ids"] for d in user["docs"][:5]
    ]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(user["tokenizer"]) + 4
    tok = user["tokenizer"]  # its special ids, so generate() stops at the end of a document
    assert (model.config.bos_token_id, model.config.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    # a continuation with another tokenizer (the same ids, other bytes) is refused, naming it
    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    other.write_text(json.dumps(json.loads((user["dir"] / "tokenizer.json").read_text()), indent=1))
    proc = train_py(run, f"data.tokenizer={other}", "checkpoint.resume=latest", "train.steps=3")
    assert proc.returncode != 0 and "the tokenizer differs" in proc.stderr, proc.stderr
    # the same command line resumes the checkpoint in a new run directory at another layout: the
    # model and its tokenization come from the checkpoint's manifest
    moved = tmp_path / "moved"
    proc = train_py(moved, *args[:4], "dist.world_size=2", f"checkpoint.resume={ckpt}", "train.steps=3")
    assert proc.returncode == 0, proc.stderr
    assert "(one rank), loaded into 2 at stage 1 (dp 2) by parameter name" in proc.stdout, proc.stdout
    assert [
        r["step"]
        for r in map(json.loads, (moved / "metrics.jsonl").read_text().splitlines())
        if r.get("type") == "step"
    ] == [3]


def test_a_mixture_of_document_sources_trains_on_each_ones_tokens(user, tmp_path):
    """data.mixture with model.init_from alone: each jsonl source encoded on its own with the
    directory's tokenizer, and step 1's loss is transformers' on the batch the mixture draws from
    those ids (tests/test_mixture.py checks the drawing itself)."""
    other = {**user, "docs": _documents(60, 7)}
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in other["docs"]))
    run, sources = tmp_path / "run", f"[{user['corpus']},{tmp_path / 'other.jsonl'}]"
    args = [f"model.init_from={user['dir']}", "data=mixture", f"data.mixture={sources}", "data.weights=[1,2]"]
    args += [f"data.cache_dir={tmp_path / 'cache'}", "dist.world_size=2", "train.steps=1"]
    proc = train_py(run, *args, "checkpoint.every_steps=0", "metrics.progress_every=0")
    assert proc.returncode == 0, proc.stderr
    assert len(list((tmp_path / "cache").glob("*.shards"))) == 2
    cfg = RunConfig.from_dict(compose_tree(args))
    windows = [
        SourceWindows(np.asarray(_expected_ids(u)), SEQ, cfg.seed, s) for s, u in enumerate([user, other])
    ]
    batches = MixedBatches(windows, cfg.data.shares, BatchPlan(cfg.global_batch, 1, 1), cfg.seed, {})
    ((x, y),) = batches.step_batches(1, 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(user["dir"], attn_implementation="eager")
    with torch.no_grad():
        want = float(model.eval()(input_ids=x, labels=y.contiguous(), shift_labels=y.contiguous()).loss)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (record,) = [r for r in records if r.get("type") == "step"]
    assert abs(float.fromhex(record["loss_hex"]) - want) <= 1e-5, (record["loss_hex"], want)
    assert record["mixture"] == batches.step_fields(1)["mixture"] and record["mixture"][1] > 0


def test_held_out_documents_are_whole_and_from_the_end(user, tmp_path):
    d = DataConfig(kind="text", path=str(user["corpus"]), tokenizer=str(user["dir"]), val_fraction=0.1)
    tok = pretrained.PretrainedTokenizer(d.tokenizer)
    cache, built = pretrained.ensure(d, tok, 304)
    assert built and not pretrained.ensure(d, tok, 304)[1]  # the second run reuses it
    tokens = cache.tokens()
    sizes = [len(t.encode()) for t in user["docs"]]
    held = documents.held_out_count(sizes, 0.1)
    assert sum(sizes[len(sizes) - held :]) >= int(sum(sizes) * 0.1) > sum(sizes[len(sizes) - held + 1 :])
    train_ids = [i for t in user["docs"][:-held] for i in tok.encode_document(t)]
    assert tokens[: cache.val_start].tolist() == train_ids and tokens.tolist() == _expected_ids(user)
    assert documents.held_out_count([3, 0, 5], 0.0) == 0 and documents.held_out_count([], 0.5) == 0


@pytest.mark.parametrize(
    "line, problem",
    [
        ("{not json", "line 2 is not JSON"),
        ('{"body": "x"}', "line 2 has no string field 'text' (data.text_field)"),
        ('{"text": 3}', "line 2 has no string field 'text' (data.text_field)"),
    ],
)
def test_a_bad_jsonl_line_is_named(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=re.escape(problem)):
        list(documents.documents(text_source.scan(path, documents.SUFFIXES), "text"))


def _write_parquet(path: Path, columns: dict) -> None:
    """A parquet file written by pyarrow in a child process (importing it starts threads)."""
    code = "import json, sys, pyarrow, pyarrow.parquet as pq\n"
    code += "pq.write_table(pyarrow.table(json.loads(sys.argv[2])), sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(path), json.dumps(columns)], check=True)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="needs the `parquet` extra (pyarrow)")
def test_parquet_documents_are_the_jsonl_ones(user, tmp_path):
    """The same documents as a parquet file (the `parquet` extra) encode to the same ids; a missing
    column, a row that is not a string or a file that is not parquet is one line naming the file."""
    path = tmp_path / "docs" / "part-0.parquet"
    path.parent.mkdir()
    _write_parquet(path, {"id": list(range(80)), "body": user["docs"]})
    d = DataConfig(kind="text", path=str(path.parent), tokenizer=str(user["dir"]), text_field="body")
    cache, _ = pretrained.ensure(d, pretrained.PretrainedTokenizer(d.tokenizer), 304)
    assert cache.tokens().tolist() == _expected_ids(user)
    for columns, problem in [
        ({"text": ["a"]}, "no column 'body' (data.text_field): it has ['text']"),
        ({"body": ["a", None]}, "row 1 of column 'body' is not a string: None"),
    ]:
        _write_parquet(path, columns)
        with pytest.raises(DataError, match=re.escape(f"data.path {path}: {problem}")):
            pretrained.ensure(d, pretrained.PretrainedTokenizer(d.tokenizer), 304)
    path.write_text("not parquet")
    with pytest.raises(DataError, match=re.escape(f"data.path {path}: not a parquet file: ")):
        pretrained.ensure(d, pretrained.PretrainedTokenizer(d.tokenizer), 304)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_records_with_a_plain_text_tokenizer_are_refused_before_any_worker_starts(user, tokenizer):
    """Bytes or a BPE trained on the text would read a jsonl file's syntax as the text."""
    extra = ["data.vocab_size=512"] if tokenizer == "bpe" else []
    cfg = RunConfig.from_dict(
        compose_tree(["data=text", f"data.path={user['corpus']}", f"data.tokenizer={tokenizer}", *extra])
    )
    with pytest.raises(
        DataError, match=f"holds documents as records: data.tokenizer={tokenizer} reads plain"
    ):
        check_source(cfg)


def test_a_tokenizer_without_end_of_text_and_a_small_model_are_refused(user, tmp_path):
    bare = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match="the tokenizer has no end-of-text token"):
        pretrained.PretrainedTokenizer(tmp_path)
    args = ["model=llama", "model.vocab_size=100", "data=text", f"data.path={user['corpus']}"]
    top = len(user["tokenizer"]) - 1
    with pytest.raises(
        ConfigError, match=rf"has token ids up to {top} but model.vocab_size=100: the model's"
    ):
        RunConfig.from_dict(compose_tree([*args, f"data.tokenizer={user['dir']}"]))
    with pytest.raises(
        ConfigError, match=r"^data.tokenizer must be bytes, bpe or the path of a tokenizer .*nowhere does not"
    ):
        RunConfig.from_dict(compose_tree([*args, f"data.tokenizer={tmp_path / 'nowhere'}"]))
