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
behind a pipeline) + KAPPA x bytes in flight at once (sent and received: memory traffic beyond
the caches), all on the busiest rank, + THETA x bytes + NU x messages that all ranks send
together (ranks that share cores and memory bandwidth slow each other down), in seconds; the
default is the cheapest candidate (ties: the earlier one).

Why committed constants, not a probe per process group: the reduction algorithms add in different
orders (exchange and direct: rank order 0..N-1; ring: around the ring; rabenseifner / halving: a
fixed pairwise tree), so the choice decides the bits of every reduced value. A probe's timing
noise could then give two runs of one job -- or a resumed run -- different sums, and bitwise
resume and the golden losses would break. Constants committed here make the choice a pure
function of (collective, B, N), the same on every rank and in every run (and a run resumed on
another machine still adds in the same order). They were fitted by a grid search to
``benchmarks/collectives.py --algos`` tables (every algorithm forced, 1 KB - 16 MB, 4 and 8 ranks
on the shared 2-core machine at load average ~20; 38 rows), minimising the total time of the
chosen algorithms, under the constraint that every all_reduce below 1 MiB keeps rank order
(exchange or direct) at 2-8 ranks: the choices took 8% longer in all than the fastest algorithm of
each row (a choice that minimised the mean per-row ratio instead, 3.5% over, picked direct over
ring at 16 MB, where ring measured 1.14-1.21x faster). Worst misses: 1.46x (8-rank 4 MB broadcast,
scatter instead of tree), 1.45x (4-rank 1 MB all_reduce, direct instead of exchange). The tables
are ``benchmarks/cost_model_tables.txt``; ``benchmarks/fit_cost_model.py`` repeats the search.
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
    alpha: float = 1.5e-3  # one level of waiting: a wake-up (ranks outnumber cores here)
    mu: float = 100e-6  # one gloo message posted and completed, on the busiest rank
    beta: float = 0.3e-9  # one byte sent by the busiest rank (~3 GB/s per rank over loopback)
    gamma: float = 2.0e-9  # one byte reduced and not hidden behind a pipeline (torch.add)
    theta: float = 0.15e-9  # one byte sent by any rank: all ranks share the cores and memory
    nu: float = 30e-6  # one message sent by any rank: likewise (a wake-up on a shared core)
    kappa: float = 1.0e-9  # one byte in flight at once on a rank (memory traffic)
    segment: int = 1 << 20  # pipeline granularity of ring / chain, bytes

    def cost(
        self,
        levels: float,
        messages: float,
        sent: float,
        reduced: float,
        inflight: float,
        total: float,
        total_messages: float,
    ) -> float:
        return (
            self.alpha * levels
            + self.mu * messages
            + self.beta * sent
            + self.gamma * reduced
            + self.kappa * inflight
            + self.theta * total
            + self.nu * total_messages
        )


MEASURED = CostModel()


def _shape(collective: str, algo: str, b: float, n: int, m: CostModel) -> tuple[float, ...]:
    """(levels, messages, bytes sent, bytes reduced, bytes in flight at once) on the busiest rank's
    critical path, then the bytes and the messages all ranks send together."""
    log_n, p = math.ceil(math.log2(n)), 1 << (n.bit_length() - 1)
    log_p, r = p.bit_length() - 1, int(n != p)
    chunk = b / n
    segs = max(1, math.ceil(chunk / m.segment))
    seg = min(m.segment, chunk)
    if collective == "all_reduce":
        shape = {
            "exchange": (1, 2 * (n - 1), (n - 1) * b, (n - 1) * b, 2 * (n - 1) * b),
            "direct": (2, 4 * (n - 1), 2 * (n - 1) * chunk, (n - 1) * chunk, 2 * (n - 1) * chunk),
            "ring": (2 * (n - 1), 4 * (n - 1) * segs, 2 * (n - 1) * chunk, (n - 1) * seg, 4 * seg),
            "rabenseifner": (
                2 * log_p + 2 * r,
                4 * log_p + 4 * r,
                2 * (p - 1) / p * b + r * b,
                (p - 1) / p * b + r * b,
                b + 2 * r * b,
            ),
        }[algo]
    elif collective == "reduce_scatter":
        shape = {
            "direct": (1, 2 * (n - 1), (n - 1) * chunk, (n - 1) * chunk, 2 * (n - 1) * chunk),
            "ring": (n - 1, 2 * (n - 1) * segs, (n - 1) * chunk, (n - 1) * seg, 2 * seg),
            "halving": (
                log_p + 2 * r,
                2 * log_p + 2 * r,
                (p - 1) / p * b + r * b,
                (p - 1) / p * b + r * b,
                b + 2 * r * b,
            ),
        }[algo]
    elif collective == "all_gather":
        shape = {
            "direct": (1, 2 * (n - 1), (n - 1) * chunk, 0, 2 * (n - 1) * chunk),
            "ring": (n - 1, 2 * (n - 1) * segs, (n - 1) * chunk, 0, 2 * seg),
            "bruck": (log_n, 2 * log_n, (n - 1) * chunk, 0, b),
        }[algo]
    elif collective == "broadcast":  # only the root's sends, not N of them
        if algo == "scatter":
            lv, msgs, sent, _, peak, total, count = _shape(
                "all_gather", choose_algorithm("all_gather", int(b), n, m), b, n, m
            )
            return (
                1 + lv,
                n - 1 + msgs,
                (n - 1) * chunk + sent,
                0,
                peak,
                (n - 1) * chunk + total,
                n - 1 + count,
            )
        full = max(1, math.ceil(b / m.segment))
        seg = min(m.segment, b)
        return {
            "flat": (1, n - 1, (n - 1) * b, 0, (n - 1) * b, (n - 1) * b, n - 1),
            "tree": (log_n, log_n, log_n * b, 0, log_n * b, (n - 1) * b, n - 1),
            "chain": (n - 1, 2 * full, b + (n - 2) * seg, 0, 2 * seg, (n - 1) * b, (n - 1) * full),
        }[algo]
    else:
        raise ValueError(f"unknown collective {collective!r}; expected one of {sorted(CANDIDATES)}")
    return (*shape, n * shape[2], n * shape[1] / 2)  # half of the messages are sends


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
