"""The sharded token cache (distlib/app/data/token_shards.py) against tokenizers' own batch encoding.

Corpus: ``--mb`` megabytes (default 1024) of jsonl written by ``corpus()`` (seeded pseudo-words,
documents of 20-400 words; not committed, regenerated into ``--dir``), and a byte-level BPE of
8,192 ids that ``tokenizers`` trains on its first 4 MB, saved with ``</s>`` as end-of-text.
Measured in this invocation, on the same documents:

    tokenizers    ``Tokenizer.encode_batch`` over every document, 10,000 at a time, in one process
                  with its own threads (all cores), each document's ids plus its </s> counted
    ours N        ``pretrained.ensure`` (what a run does before training: rank 0 counts the
                  documents, then every rank encodes its block and writes its shards) at world
                  size N (1 and 2), each into a fresh cache directory

Reported: wall seconds, tokens/s and its ratio to tokenizers', the peak resident memory of each
process above what it held before the build (``ru_maxrss``), and whether the caches of every world
size are the same bytes. Table on stdout, JSON in benchmarks/results/token_cache.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from multiproc import run_ranks  # noqa: E402

from distlib.app.config.data_group import DataConfig  # noqa: E402
from distlib.app.data import pretrained  # noqa: E402

WORDS = 4096


def corpus(path: Path, mb: int, seed: int = 0) -> int:
    """Write ``mb`` MB of jsonl documents to ``path``; returns the document count."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, size=int(rng.integers(2, 10)))) for _ in range(WORDS)]
    want, written, docs = mb << 20, 0, 0
    with open(path, "w") as f:
        while written < want:
            lengths = rng.integers(20, 400, size=1000)
            picks = rng.integers(0, WORDS, size=int(lengths.sum()))
            at = 0
            for n in lengths:
                line = json.dumps({"text": " ".join(words[i] for i in picks[at : at + n])}) + "\n"
                at += n
                f.write(line)
                written += len(line)
                docs += 1
    return docs


TRAIN = """
import json, sys, tokenizers
path, out = sys.argv[1], sys.argv[2]
texts, size = [], 0
for line in open(path):
    texts.append(json.loads(line)["text"]); size += len(line)
    if size > 4 << 20: break
tok = tokenizers.Tokenizer(tokenizers.models.BPE())
tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = tokenizers.decoders.ByteLevel()
trainer = tokenizers.trainers.BpeTrainer(vocab_size=8192, special_tokens=["</s>"], show_progress=False,
    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(texts, trainer)
tok.save(out + "/tokenizer.json")
open(out + "/tokenizer_config.json", "w").write(json.dumps({"eos_token": "</s>"}))
"""

THEIRS = """
import json, resource, sys, time, tokenizers
tok = tokenizers.Tokenizer.from_file(sys.argv[2] + "/tokenizer.json")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start, count, batch = time.perf_counter(), 0, []
def run(batch):
    return sum(len(e.ids) + 1 for e in tok.encode_batch(batch))
for line in open(sys.argv[1]):
    batch.append(json.loads(line)["text"])
    if len(batch) == 10000:
        count += run(batch); batch = []
count += run(batch) if batch else 0
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "tokens": count, "rss_mb": (peak - before) / 1024}))
"""


def _ours(comm, d: DataConfig) -> dict:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    cache, _ = pretrained.ensure(d, pretrained.PretrainedTokenizer(d.tokenizer), 8192, comm, lambda s: None)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "seconds": seconds,
        "tokens": cache.index["count"],
        "rss_mb": (peak - before) / 1024,
        "shards": [s["sha256"] for s in cache.index["shards"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024, help="corpus size in MB (default 1024)")
    ap.add_argument("--dir", default="/tmp/token_cache_bench", help="where the corpus and caches go")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "token_cache.json"))
    args = ap.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    path, tok = work / f"corpus{args.mb}mb.jsonl", work / "tokenizer"
    if not path.exists():
        corpus(path, args.mb)
    if not (tok / "tokenizer.json").exists():
        tok.mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-c", TRAIN, str(path), str(tok)], check=True)
    rows = {}
    for world in (1, 2):
        cache = work / f"cache_ws{world}"
        subprocess.run(["rm", "-rf", str(cache)], check=True)
        d = DataConfig(kind="text", path=str(path), tokenizer=str(tok), cache_dir=str(cache))
        ranks = run_ranks(_ours, world, d, timeout_s=24 * 3600)
        rows[f"ours {world}"] = {
            "seconds": max(r["seconds"] for r in ranks),
            "tokens": ranks[0]["tokens"],
            "rss_mb": [round(r["rss_mb"], 1) for r in ranks],
            "shards": ranks[0]["shards"],
        }
    theirs = subprocess.run(
        [sys.executable, "-c", THEIRS, str(path), str(tok)], check=True, capture_output=True, text=True
    )
    rows["tokenizers"] = json.loads(theirs.stdout)
    same = rows["ours 1"]["shards"] == rows["ours 2"]["shards"]
    base = rows["tokenizers"]["tokens"] / rows["tokenizers"]["seconds"]
    print(f"corpus: {path} ({path.stat().st_size / 2**20:.0f} MB), {rows['ours 1']['tokens']:,} tokens")
    print(f"{'variant':<12} {'seconds':>9} {'tokens/s':>12} {'vs tokenizers':>14}  peak RSS above start (MB)")
    for name, r in rows.items():
        rate = r["tokens"] / r["seconds"]
        print(f"{name:<12} {r['seconds']:9.1f} {rate:12,.0f} {rate / base:14.2f}  {r['rss_mb']}")
    print(f"caches at world sizes 1 and 2 the same bytes: {same}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"mb": args.mb, "rows": rows, "same_bytes": same}, indent=1))


if __name__ == "__main__":
    main()
