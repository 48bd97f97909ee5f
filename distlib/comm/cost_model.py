"""Which algorithm each collective uses: a latency-bandwidth cost model with committed constants.

Every algorithm is described by what one rank (the busiest) does on its critical path, for B
tensor bytes on N ranks (L = ceil(log2 N), p = the largest power of two <= N, r = N - p,
s = pipeline segments of a chunk):

| collective     | algorithm    | levels of waiting    | bytes sent per rank        | reduced per rank  |
|----------------|--------------|----------------------|----------------------------|-------------------|
| all_reduce     | exchange     | 1                    | (N-1) B                    | (N-1) B           |
| all_reduce     | direct       | 2                    | 2 (N-1)/N B                | (N-1)/N B         |
| all_reduce     | ring         | 2 (N-1), pipelined   | 2 (N-1)/N B                | one segment/step  |
| all_reduce     | rabenseifner | 2 log2 p (+2 if r)   | 2 (p-1)/p B (+B if r)      | (p-1)/p B (+B)    |
| reduce_scatter | direct       | 1                    | (N-1)/N B                  | (N-1)/N B         |
| reduce_scatter | ring         | N-1, pipelined       | (N-1)/N B                  | one segment/step  |
| reduce_scatter | halving      | log2 p (+2 if r)     | (p-1)/p B (+B if r)        | (p-1)/p B (+B)    |
| all_gather     | direct       | 1                    | (N-1)/N B                  | -                 |
| all_gather     | ring         | N-1, pipelined       | (N-1)/N B                  | -                 |
| all_gather     | bruck        | L                    | (N-1)/N B                  | -                 |
| broadcast      | flat         | 1                    | (N-1) B (root)             | -                 |
| broadcast      | tree         | L                    | L B (root)                 | -                 |
| broadcast      | chain        | N-1, pipelined       | B + (N-2) segment          | -                 |
| broadcast      | scatter      | 1 + all_gather's     | (N-1)/N B + all_gather's   | -                 |

cost = ALPHA x levels + MU x messages + BETA x bytes sent + GAMMA x bytes reduced (not hidden
behind a pipeline), all on the busiest rank, + THETA x the bytes all ranks send together (ranks
that share cores and memory bandwidth slow each other down), in seconds; the default is the
cheapest candidate (ties: the earlier one).

Why committed constants, not a probe per process group: the reduction algorithms add in different
orders (exchange and direct: rank order 0..N-1; ring: around the ring; rabenseifner / halving: a
fixed pairwise tree), so the choice decides the bits of every reduced value. A probe's timing
noise could then give two runs of one job -- or a resumed run -- different sums, and bitwise
resume and the golden losses would break. Constants committed here make the choice a pure
function of (collective, B, N), the same on every rank and in every run; they were fitted by hand
to ``benchmarks/collectives.py --algos`` on the 2-core machine (4 ranks; see benchmarks/README.md).
A ``CostModel`` passed to ``choose_algorithm`` (tests do, to reach the large-tensor paths with
small tensors) overrides them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

CANDIDATES = {
    "all_reduce": ("exchange", "direct", "ring", "rabenseifner"),
    "reduce_scatter": ("direct", "ring", "halving"),
    "all_gather": ("direct", "ring", "bruck"),
    "broadcast": ("flat", "tree", "chain", "scatter"),
}


@dataclass(frozen=True)
class CostModel:
    alpha: float = 400e-6       # one level of waiting: a wake-up (ranks outnumber cores here)
    mu: float = 40e-6           # one gloo message posted and completed, on the busiest rank
    beta: float = 0.3e-9        # one byte sent by the busiest rank (~3 GB/s per rank over loopback)
    gamma: float = 0.3e-9       # one byte reduced and not hidden behind a pipeline (torch.add)
    theta: float = 0.3e-9       # one byte sent by any rank: all ranks share the cores and memory
    segment: int = 1 << 20      # pipeline granularity of ring / chain, bytes

    def cost(self, levels: float, messages: float, sent: float, reduced: float, total: float) -> float:
        return (self.alpha * levels + self.mu * messages + self.beta * sent + self.gamma * reduced
                + self.theta * total)


MEASURED = CostModel()


def _shape(collective: str, algo: str, b: float, n: int, m: CostModel) -> tuple[float, ...]:
    """(levels, messages, bytes sent, bytes reduced) on the busiest rank's critical path, and the
    bytes all ranks send together."""
    log_n, p = math.ceil(math.log2(n)), 1 << (n.bit_length() - 1)
    log_p, r = p.bit_length() - 1, int(n != p)
    chunk = b / n
    segs = max(1, math.ceil(chunk / m.segment))
    seg = min(m.segment, chunk)
    if collective == "all_reduce":
        shape = {"exchange": (1, 2 * (n - 1), (n - 1) * b, (n - 1) * b),
                 "direct": (2, 4 * (n - 1), 2 * (n - 1) * chunk, (n - 1) * chunk),
                 "ring": (2 * (n - 1), 4 * (n - 1) * segs, 2 * (n - 1) * chunk, (n - 1) * seg),
                 "rabenseifner": (2 * log_p + 2 * r, 4 * log_p + 4 * r, 2 * (p - 1) / p * b + r * b,
                                  (p - 1) / p * b + r * b)}[algo]
    elif collective == "reduce_scatter":
        shape = {"direct": (1, 2 * (n - 1), (n - 1) * chunk, (n - 1) * chunk),
                 "ring": (n - 1, 2 * (n - 1) * segs, (n - 1) * chunk, (n - 1) * seg),
                 "halving": (log_p + 2 * r, 2 * log_p + 2 * r, (p - 1) / p * b + r * b,
                             (p - 1) / p * b + r * b)}[algo]
    elif collective == "all_gather":
        shape = {"direct": (1, 2 * (n - 1), (n - 1) * chunk, 0),
                 "ring": (n - 1, 2 * (n - 1) * segs, (n - 1) * chunk, 0),
                 "bruck": (log_n, 2 * log_n, (n - 1) * chunk, 0)}[algo]
    elif collective == "broadcast":                     # only the root's sends, not N of them
        if algo == "scatter":
            lv, msgs, sent, _, total = _shape("all_gather", choose_algorithm("all_gather", int(b), n, m), b, n, m)
            return 1 + lv, n - 1 + msgs, (n - 1) * chunk + sent, 0, (n - 1) * chunk + total
        full = max(1, math.ceil(b / m.segment))
        return {"flat": (1, n - 1, (n - 1) * b, 0, (n - 1) * b),
                "tree": (log_n, log_n, log_n * b, 0, (n - 1) * b),
                "chain": (n - 1, 2 * full, b + (n - 2) * min(m.segment, b), 0, (n - 1) * b)}[algo]
    else:
        raise ValueError(f"unknown collective {collective!r}; expected one of {sorted(CANDIDATES)}")
    return (*shape, n * shape[2])


def estimate(collective: str, algo: str, nbytes: int, world: int, model: CostModel = MEASURED) -> float:
    """The modelled seconds of one call."""
    return model.cost(*_shape(collective, algo, float(nbytes), world, model))


@functools.lru_cache(maxsize=4096)
def choose_algorithm(collective: str, nbytes: int, world: int, model: CostModel = MEASURED) -> str:
    """The cheapest algorithm in the model for ``nbytes`` on ``world`` ranks. A pure function, so
    it is memoised: pricing every candidate takes ~40 us, a 1 KB gloo message ~100 us."""
    if collective not in CANDIDATES:
        raise ValueError(f"unknown collective {collective!r}; expected one of {sorted(CANDIDATES)}")
    if world <= 1:
        return CANDIDATES[collective][0]
    return min(CANDIDATES[collective], key=lambda a: estimate(collective, a, nbytes, world, model))
