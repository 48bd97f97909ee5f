"""The ring's attention work per rank with packed documents (``data.document_mask``): exact counts.

    .venv/bin/python benchmarks/ring_documents.py           # seq 4096, cp 2/4/8, 4 document sizes: ~3 s
    .venv/bin/python benchmarks/ring_documents.py --quick   # seq 512, cp 2 and 4, 2 trials: ~1 s

A ring rank attends (query chunk, key chunk) blocks (``distlib/parallel/context/ring_blocks.py``):
2 cp + 1 of them per sequence with causal attention alone, the same on every rank (the zig-zag
layout). With documents, a key chunk that ends before every document of a query chunk starts is
skipped, so the work falls, unevenly: rank 0's early chunk has no chunk before it. So the ranks
then hold the chunks ``distlib/parallel/context/balance.py`` pairs for the micro-batch's documents.

Each row: sequences of ``--seq`` tokens, ``--batch`` of them per micro-batch, cut into documents
of geometric lengths with the given mean (``inf``: one text, no end token), ``--trials`` draws from
seed 0. ``blocks`` is a rank's count over the whole ring (forward; the backward attends the same),
``of`` the causal count 2 cp + 1; ``max/mean`` the busiest rank over the mean, averaged over the
draws, ``worst`` its largest: for the ring as it runs (the balanced pairs; the ``Layout``'s own
blocks) and, for comparison, for the zig-zag's pairs (the same chunks' work, summed as the
zig-zag pairs them). Counts, not times: the same on every machine.

JSON: benchmarks/results/ring_documents.json (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import numpy as np
import torch

from distlib.comm.group import Comm
from distlib.parallel.context import balance, chunks
from distlib.parallel.context.ring_blocks import Layout, block_count
from distlib.parallel.documents import Documents


def documents(rng: np.random.Generator, batch: int, seq: int, mean: float) -> Documents:
    """``batch`` sequences cut into documents of geometric lengths of ``mean`` (inf: none)."""
    tokens = torch.ones(batch * seq, dtype=torch.int64)
    if math.isfinite(mean):
        ends = np.cumsum(rng.geometric(1 / mean, size=batch * seq))
        tokens[torch.from_numpy(ends[ends < batch * seq])] = 0
    return Documents.of_tokens(tokens.view(batch, seq), 0)


def blocks_per_rank(docs: Documents, cp: int) -> list[int]:
    """Each rank's (query chunk, key chunk) blocks over the whole ring, as the ring runs."""
    seq, owned = docs.seq_len, balance.owned(docs, cp)
    counts = []
    for r in range(cp):
        held = chunks.positions(seq, cp, r, owned=owned)
        lay = Layout(Comm(ranks=tuple(range(cp)), rank=r), held, seq // cp, docs)
        counts.append(sum(b1 - b0 for s in range(cp) for _, b0, b1, _ in lay.blocks((r - s) % cp)))
    return counts


def zigzag_blocks(docs: Documents, cp: int) -> list[int]:
    """Each rank's blocks had it kept the zig-zag's chunks: the same chunks' work, paired so."""
    chunk = docs.seq_len // (2 * cp)
    work = balance.chunk_work(docs.chunk_starts(chunk), chunk)
    return [work[a] + work[b] for a, b in chunks.zigzag(cp)]


def imbalance(draws: list[list[int]]) -> tuple[float, float]:
    """The busiest rank over the mean: averaged over the draws, and the largest."""
    ratios = [max(d) / (sum(d) / len(d)) for d in draws]
    return sum(ratios) / len(ratios), max(ratios)


def row(seq: int, cp: int, mean: float, batch: int, trials: int) -> dict:
    rng = np.random.default_rng(0)
    docs = [documents(rng, batch, seq, mean) for _ in range(trials)]
    draws, zigzag = [blocks_per_rank(d, cp) for d in docs], [zigzag_blocks(d, cp) for d in docs]
    (mean_ratio, worst), (zz_mean, zz_worst) = imbalance(draws), imbalance(zigzag)
    return {
        "seq": seq,
        "cp": cp,
        "mean_document": mean if math.isfinite(mean) else None,
        "batch": batch,
        "blocks": draws,
        "zigzag_blocks": zigzag,
        "causal_blocks": block_count(cp, 0),
        "mean_blocks": sum(map(sum, draws)) / (cp * trials),
        "max_over_mean": mean_ratio,
        "worst_max_over_mean": worst,
        "zigzag_max_over_mean": zz_mean,
        "zigzag_worst_max_over_mean": zz_worst,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--means", type=float, nargs="+", default=[128, 512, 2048, math.inf])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument(
        "--quick", action="store_true", help="seq 512, cp 2 and 4, means 64 and inf, 2 trials"
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "ring_documents.json"))
    args = parser.parse_args()
    if args.quick:
        args.seq, args.cps, args.means, args.trials = 512, [2, 4], [64, math.inf], 2
    rows = [
        row(args.seq, cp, mean, batch, args.trials)
        for cp in args.cps
        for mean in args.means
        for batch in args.batches
    ]
    print(f"{'':>32} {'balanced':>16} {'zig-zag':>16}")
    print(
        f"{'cp':>3} {'mean doc':>9} {'batch':>5} {'blocks':>7} {'of':>4} "
        f"{'max/mean':>9} {'worst':>6} {'max/mean':>9} {'worst':>6}"
    )
    for r in rows:
        mean = "inf" if r["mean_document"] is None else f"{r['mean_document']:.0f}"
        print(
            f"{r['cp']:>3} {mean:>9} {r['batch']:>5} {r['mean_blocks']:>7.1f} {r['causal_blocks']:>4} "
            f"{r['max_over_mean']:>9.3f} {r['worst_max_over_mean']:>6.3f} "
            f"{r['zigzag_max_over_mean']:>9.3f} {r['zigzag_worst_max_over_mean']:>6.3f}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"seq": args.seq, "trials": args.trials, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
