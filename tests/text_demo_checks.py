"""What `make text-demo` must show beyond the lines docs/beyond.md prints: a Llama with a BPE
tokenizer trained on data/sample.txt at 4 ranks with ZeRO-1, exported as a Hugging Face directory
and continued by transformers' own generate(), whose greedy tokens are our model's, and which has
learned the text (its held-out loss below a unigram model's).

The documents' own `make text-demo` (200 steps: held-out loss 1.6 against the unigram 4.6) is the
run these checks read: tests/test_doc_commands.py calls ``check`` from the documents group that
runs it, so the demo trains once per suite."""

from __future__ import annotations

import collections
import math
import re
from pathlib import Path

import torch

from distlib.app.checkpointing.sampling import generate, load_model
from distlib.app.data.bpe import load_tokenizer, tokenizer_for_checkpoint
from distlib.checkpoint.sharded import read_manifest

COMMAND = "make text-demo"
RUN_DIR = "outputs/text-demo"
VAL_FRACTION = 0.1  # conf/data/text.yaml's data.val_fraction: the text's last 10% is held out


def check(repo: Path, stdout: str) -> None:
    """The demo run in ``repo`` (a copy of the repository) that printed ``stdout``."""
    run_dir = repo / RUN_DIR
    checkpoint = max((run_dir / "checkpoints").glob("step_*"))
    _trained_and_exported(stdout, run_dir)
    _greedy_continuation_is_ours(stdout, checkpoint)
    _beats_a_unigram_model(repo, run_dir, checkpoint)


def _trained_and_exported(stdout: str, run_dir: Path) -> None:
    assert "RESUME VERIFIED" in stdout
    assert f"wrote {RUN_DIR}/hf: llama" in stdout, stdout[-1500:]
    files = {p.name for p in (run_dir / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files


def _greedy_continuation_is_ours(stdout: str, checkpoint: Path) -> None:
    """transformers' greedy continuation (scripts/generate_hf.py) is our model's own, token for
    token; the sampled one (temperature 0.8, top-k 20) starts with its prompt and adds to it."""
    tokenizer = tokenizer_for_checkpoint(checkpoint, read_manifest(checkpoint))
    ids = generate(load_model(checkpoint), tokenizer.encode("Rank zero"), 40, temperature=0)
    assert f"\n{tokenizer.decode(ids)}\n" in stdout, stdout[-1500:]
    assert re.search(r"^Every rank\S*\s+\S", stdout, re.MULTILINE), stdout[-1500:]


def _held_out_text(repo: Path) -> tuple[str, str]:
    """data/sample.txt split as data.val_fraction splits it: (train text, held-out text)."""
    raw = (repo / "data" / "sample.txt").read_bytes()
    cut = len(raw) - int(len(raw) * VAL_FRACTION)
    while raw[cut] & 0xC0 == 0x80:  # back to the start of a UTF-8 character
        cut -= 1
    return raw[:cut].decode(), raw[cut:].decode()


def _beats_a_unigram_model(repo: Path, run_dir: Path, checkpoint: Path) -> None:
    tokenizer = tokenizer_for_checkpoint(checkpoint, read_manifest(checkpoint))
    train_text, held_out = _held_out_text(repo)
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
