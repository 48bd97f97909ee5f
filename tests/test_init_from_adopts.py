"""Nothing the run knows is asked twice (issue 32 item 6): ``model.init_from=DIR`` takes the model's
family and shape from the directory's config.json, as transformers' ``from_pretrained`` does; what
the command line sets on purpose is kept (a shorter context), a key set to another value than the
directory's is one line naming both values before any worker starts; and the model's vocabulary
follows the tokenizer's (``data.tokenizer=bpe data.vocab_size=512`` needs no ``model.vocab_size``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from e2e import train as train_py
from family_models import perturb_, quiet_transformers
from forkrun import run_script
from multiproc import run_ranks
from trainrun import compose_tree, train

import train as train_script
from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.data.batches import BatchPlan, GlobalBatches, make_corpus, split_heldout

pytestmark = pytest.mark.slow
transformers = quiet_transformers()

QUIET = ["dist.world_size=1", "train.steps=2", "metrics.progress_every=0"]
# Every shape key typed out, as the directories below hold them (what init_from asked for before).
TYPED = {
    "llama": [
        "model=llama", "model.vocab_size=96", "model.seq_len=32", "model.dim=64", "model.n_heads=4",
        "model.n_kv_heads=2", "model.n_layers=2", "model.mlp_hidden=100", "model.norm_eps=1e-6",
        "model.rope_theta=500.0",
    ],
    "gpt2": [
        "model=gpt2", "model.vocab_size=80", "model.seq_len=24", "model.dim=48", "model.n_heads=4",
        "model.n_layers=2", "model.tie_embeddings=true",
    ],
}  # fmt: skip


def _save(config, path: Path, seed: int) -> Path:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    perturb_(model, seed)  # norms and biases away from 1 and 0: a misplaced one changes the loss
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, Path]:
    """Tiny models saved by transformers' save_pretrained, as a new user has them."""
    root = tmp_path_factory.mktemp("hf")
    llama = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=100,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        rope_theta=500.0,
    )
    gpt2 = transformers.GPT2Config(
        vocab_size=80, n_positions=24, n_embd=48, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    mistral = root / "mistral"  # a family we do not convert (its sliding-window attention)
    transformers.MistralConfig(hidden_size=32, num_hidden_layers=1).save_pretrained(mistral)
    mixtral = root / "mixtral"  # (its config alone: the family is refused before any weight is read)
    transformers.MixtralConfig(hidden_size=32, num_hidden_layers=1).save_pretrained(mixtral)
    return {
        "llama": _save(llama, root / "llama", 1),
        "gpt2": _save(gpt2, root / "gpt2", 2),
        "mistral": mistral,
        "mixtral": mixtral,
    }


def _first_loss(tree: dict, run_dir: Path) -> str:
    return run_ranks(train, 1, tree, str(run_dir))[0]["losses"][1]


def _hf_loss(hf_dir: Path, cfg: RunConfig) -> float:
    """transformers' own loss of step 1's batch (one rank: the whole global batch)."""
    d = cfg.data
    corpus = split_heldout(
        make_corpus(d.seed, d.total_tokens, cfg.model.vocab_size, d.follow_prob), d.val_fraction
    )
    batches = GlobalBatches(corpus[0], cfg.model.seq_len, BatchPlan(cfg.global_batch, 1, 1), cfg.seed)
    ((x, y),) = batches.step_batches(1, 0)
    y = y.contiguous()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return float(model(input_ids=x, labels=y, shift_labels=y).loss)


def _metrics_losses(run_dir: Path) -> dict[int, str]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss_hex"] for r in records if r.get("type") == "step"}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_init_from_alone_trains_as_with_every_key_typed(hf, tmp_path, family):
    """`train.py model.init_from=DIR` (no family, no shape key) trains the directory's model: its
    config is the typed run's, and its first loss is the typed run's, bit for bit, and
    transformers' own on that batch."""
    run = tmp_path / "adopted"
    proc = train_py(run, f"model.init_from={hf[family]}", *QUIET, "checkpoint.every_steps=1")
    assert proc.returncode == 0, proc.stderr
    typed = compose_tree(TYPED[family] + [f"model.init_from={hf[family]}", *QUIET])
    adopted = compose_tree([f"model.init_from={hf[family]}", *QUIET])
    assert RunConfig.from_dict(adopted) == RunConfig.from_dict(typed)
    first = _metrics_losses(run)[1]
    assert first == _first_loss(typed, tmp_path / "typed")
    want = _hf_loss(hf[family], RunConfig.from_dict(typed))
    assert abs(float.fromhex(first) - want) <= 1e-5, (float.fromhex(first), want)
    # the run's record holds the adopted shape: its continuation never reads the directory
    aside = tmp_path / "moved"
    shutil.copytree(hf[family], aside)
    shutil.rmtree(hf[family])
    try:
        again = train_py(run, "checkpoint.resume=latest", "train.steps=3")
    finally:
        os.rename(aside, hf[family])
    assert again.returncode == 0, again.stderr
    assert sorted(_metrics_losses(run)) == [1, 2, 3]


def test_a_shorter_context_typed_is_kept(hf, tmp_path):
    """model.seq_len=16 under a GPT-2 of 24 learned positions: the run trains 16-token sequences on
    the table's first 16 rows, as transformers computes them (and a Llama keeps it too)."""
    tree = compose_tree([f"model.init_from={hf['gpt2']}", "model.seq_len=16", *QUIET])
    cfg = RunConfig.from_dict(tree)
    assert (cfg.model.family, cfg.model.seq_len, cfg.model.dim) == ("gpt2", 16, 48)
    got = float.fromhex(_first_loss(tree, tmp_path / "short"))
    assert abs(got - _hf_loss(hf["gpt2"], cfg)) <= 1e-5
    llama = train_script.checked_config(compose_tree([f"model.init_from={hf['llama']}", "model.seq_len=8"]))
    assert (llama.model.seq_len, llama.model.dim) == (8, 64)


def _refused(hf_dir: Path, tmp_path: Path, *overrides: str) -> list[str]:
    """The stderr lines of a train.py start refused before any worker (exit 2, nothing left)."""
    run = tmp_path / "refused"
    proc = run_script("train.py", f"model.init_from={hf_dir}", *overrides, f"hydra.run.dir={run}")
    assert proc.returncode == 2 and proc.stdout == "" and not run.exists(), proc.stderr
    return proc.stderr.splitlines()


def test_a_key_set_against_the_directory_is_one_line(hf, tmp_path):
    llama = hf["llama"]
    assert _refused(llama, tmp_path, "model=llama", "model.dim=128") == [
        f"config error: model.init_from={llama} disagrees with keys this run sets: model.dim=128 (the "
        f"directory's: 64); leave those keys out to take the directory's values"
    ]
    assert _refused(hf["gpt2"], tmp_path, "model.seq_len=64") == [
        f"config error: model.init_from={hf['gpt2']} disagrees with keys this run sets: model.seq_len=64 "
        f"(the directory's learned positions: 24); leave those keys out to take the directory's values"
    ]
    assert _refused(hf["gpt2"], tmp_path, "model=llama") == [
        f"config error: model.init_from={hf['gpt2']} holds a gpt2 model but model.family=llama; leave the "
        f"family out (no model=... nor model.family=...) to take the directory's"
    ]
    assert _refused(hf["mixtral"], tmp_path, "model=llama") == [
        f"config error: model.init_from={hf['mixtral']} holds a mixtral model but model.family=llama; leave "
        f"the family out (no model=... nor model.family=...) to take the directory's"
    ]
    assert _refused(hf["mistral"], tmp_path, "model=llama") == [
        f"config error: model.init_from={hf['mistral']}: model_type 'mistral' is not supported (only "
        f"'gpt2', 'llama', 'qwen3', 'mixtral', 'qwen3_moe' and 'deepseek_v3' convert exactly)"
    ]


def test_the_vocabulary_follows_the_tokenizer(hf, tmp_path):
    """data=text with a BPE of 512 tokens runs without model.vocab_size; a value set against the
    tokenizer (or a directory's) is one line naming both."""
    run = tmp_path / "bpe"
    bpe = ["data=text", "data.tokenizer=bpe", "data.vocab_size=512", f"data.cache_dir={tmp_path / 'cache'}"]
    proc = train_py(run, *bpe, *QUIET, "train.steps=1")
    assert proc.returncode == 0, proc.stderr
    assert "vocab_size: 512" in (run / ".hydra" / "config.yaml").read_text().split("optimizer:")[0]
    assert train_script.checked_config(compose_tree(["data=text"])).model.vocab_size == 256
    for overrides, line in [
        (bpe + ["model.vocab_size=256"], "data.tokenizer=bpe has 512 tokens but model.vocab_size=256"),
        (
            ["data=text", f"model.init_from={hf['llama']}"],
            "data.tokenizer=bytes has 256 tokens but model.vocab_size=96",
        ),
    ]:
        with pytest.raises(ConfigError, match=f"^{line}; "):
            RunConfig.from_dict(compose_tree(overrides))
