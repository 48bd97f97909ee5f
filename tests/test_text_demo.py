"""`make text-demo`, shortened: a Llama with a BPE tokenizer trained on data/sample.txt at 4 ranks
with ZeRO-1, exported as a Hugging Face directory, and continued by transformers' own generate()."""

from __future__ import annotations

import collections
import math
import re
import subprocess

import pytest
import torch
from e2e import ROOT

from distlib.app.checkpointing.sampling import generate, load_model
from distlib.app.data.bpe import load_tokenizer, tokenizer_for_checkpoint
from distlib.checkpoint.sharded import read_manifest

pytestmark = pytest.mark.slow

STEPS = 40  # held-out loss 2.8 against the unigram 4.6 (1.6 at 100 steps): enough to show it learned
VAL_FRACTION = 0.1  # conf/data/text.yaml's data.val_fraction: the text's last 10% is held out


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("text-demo")
    proc = subprocess.run(
        # the token cache goes to tmp: nothing is written beside data/sample.txt
        ["make", "text-demo", f"TEXT_DEMO={tmp / 'demo'}", f"TEXT_STEPS={STEPS}"]
        + [f"TEXT_ARGS=data.cache_dir={tmp / 'cache'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    checkpoint = tmp / "demo" / "checkpoints" / f"step_{STEPS:08d}"
    return proc.stdout, tmp / "demo", checkpoint


def _held_out_text() -> tuple[str, str]:
    """data/sample.txt split as data.val_fraction splits it: (train text, held-out text)."""
    raw = (ROOT / "data" / "sample.txt").read_bytes()
    cut = len(raw) - int(len(raw) * VAL_FRACTION)
    while raw[cut] & 0xC0 == 0x80:  # back to the start of a UTF-8 character
        cut -= 1
    return raw[:cut].decode(), raw[cut:].decode()


def test_the_text_demo_trains_and_exports(demo):
    stdout, run_dir, _ = demo
    assert "RESUME VERIFIED" in stdout
    assert f"wrote {run_dir / 'hf'}: llama" in stdout
    files = {p.name for p in (run_dir / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files


def test_transformers_greedy_continuation_is_our_models(demo):
    stdout, _, checkpoint = demo
    tokenizer = tokenizer_for_checkpoint(checkpoint, read_manifest(checkpoint))
    ids = generate(load_model(checkpoint), tokenizer.encode("Rank zero"), 40, temperature=0)
    assert f"\n{tokenizer.decode(ids)}\n" in stdout, stdout[-1500:]
    # the sampled continuation (temperature 0.8, top-k 20) starts with its prompt and adds to it
    assert re.search(r"^Every rank\S*\s+\S", stdout, re.MULTILINE), stdout[-1500:]


def test_the_trained_model_beats_a_unigram_model_on_held_out_text(demo):
    _, run_dir, checkpoint = demo
    tokenizer = tokenizer_for_checkpoint(checkpoint, read_manifest(checkpoint))
    train_text, held_out = _held_out_text()
    held = tokenizer.encode(held_out)
    assert load_tokenizer(run_dir / "hf").encode(held_out) == held, "the exported tokenizer is the run's"
    # unigram: token frequencies of the training text (add-one smoothed), cross-entropy on held-out
    counts, vocab = collections.Counter(tokenizer.encode(train_text)), tokenizer.vocab_size
    total = sum(counts.values()) + vocab
    unigram = -sum(math.log((counts[t] + 1) / total) for t in held) / len(held)
    model = load_model(checkpoint)
    seq = model.cfg.seq_len
    windows = torch.tensor(held[: (len(held) - 1) // seq * seq + 1])
    with torch.no_grad():
        loss = float(model(windows[:-1].view(-1, seq), windows[1:].view(-1, seq)))
    assert loss < unigram < math.log(vocab), f"held-out loss {loss:.3f}, unigram {unigram:.3f}"
