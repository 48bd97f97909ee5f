"""Hand-written collectives (distlib.collectives) vs torch's gloo collectives, same run.

Ours run three times: over gloo's pairs (``ours``), over the shared-memory segment's rings, one
message at a time (``rings``: distlib/comm/shm.py), and read from its board (``shm``: every member
writes its part once and reads the others' after a barrier, distlib/comm/board.py and
algorithms/reads.py), which is what training runs on one host use; ``copy`` is the memory-copy
bound measured alongside, every rank copying a tensor of the size at once (the least any
collective must do: write its result).

    .venv/bin/python benchmarks/collectives.py            # full: 1 KB .. 64 MB, ~3-4 min on 2 cores
    .venv/bin/python benchmarks/collectives.py --quick    # 1 KB, 64 KB, 4 MB, 16 MB: < 1 min
    .venv/bin/python benchmarks/collectives.py --algos    # also time every forced algorithm of ours
    .venv/bin/python benchmarks/collectives.py --quick --worlds 2 4 8 --ops all_reduce  # make bench's, one op

all_to_all: equal pieces (the tensor's N row blocks, one per rank), the counts given to both sides
(as the context-parallel all-to-all gives them), against ``all_to_all_single``; ours is "direct"
(no cost model chooses between its algorithms yet), --algos adds "pairwise".

Each (op, size) is warmed up, then timed for several iterations; an iteration's time is
the slowest rank's (ranks line up on a barrier first), and the table reports the median.
ratio = torch ms / ours ms, so > 1 means ours is faster. JSON: benchmarks/results/collectives.json (--out).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch
import torch.distributed as dist
from multiproc import run_ranks

from distlib.comm import collectives as C
from distlib.comm import local
from distlib.comm.algorithms import all_to_all as A2A
from distlib.comm.cost_model import CANDIDATES

warnings.filterwarnings("ignore", message=".*_tensor` is deprecated")  # *_into_tensor / *_scatter_tensor

OPS = ("broadcast", "reduce_scatter", "all_gather", "all_reduce", "all_to_all")
# every algorithm of each collective (--algos times them all); all_to_all is outside the cost model
ALGOS = {**CANDIDATES, "all_to_all": tuple(A2A.ALGORITHMS)}


def default_algorithm(op: str, nbytes: int, world: int) -> str:
    """What ours runs when no algorithm is forced: the cost model's choice, or all_to_all's default."""
    return "direct" if op == "all_to_all" else C.choose_algorithm(op, nbytes, world)


def _iters(nbytes: int) -> int:
    # many iterations: on a shared, oversubscribed machine single runs vary by milliseconds
    return 100 if nbytes <= 256 << 10 else 50 if nbytes <= 4 << 20 else 20 if nbytes <= 16 << 20 else 8


def _callables(op: str, x: torch.Tensor, comm, algo):
    """(ours, torch's) zero-argument callables for one op on a float32 tensor x."""
    n = comm.size
    lo, hi = C.chunk_bounds(x.numel(), n)[comm.rank]
    if op == "broadcast":
        return (lambda: C.broadcast(x, 0, comm, algo=algo)), (lambda: dist.broadcast(x, 0))
    if op == "reduce_scatter":
        out = torch.empty(x.numel() // n)
        return (lambda: C.reduce_scatter(x, comm, algo=algo)), (lambda: dist.reduce_scatter_tensor(out, x))
    if op == "all_gather":
        chunk = x[lo:hi].clone()
        return (
            (lambda: C.all_gather(x, x[lo:hi], comm, algo=algo)),
            (lambda: dist.all_gather_into_tensor(x, chunk)),
        )
    if op == "all_to_all":
        # N equal row blocks, counts known on both sides: no count exchange in either
        # both receive into a tensor allocated once (a fresh 64 MB costs more than its copy)
        rows, got, mine = x.view(n, -1), torch.empty_like(x), torch.empty_like(x).view(n, -1)
        ones = [1] * n
        return (lambda: C.all_to_all(rows, comm, ones, ones, algo=algo, out=mine)), (
            lambda: dist.all_to_all_single(got, x)
        )
    return (lambda: C.all_reduce(x, comm, algo=algo)), (lambda: dist.all_reduce(x))


def _time_interleaved(fns: dict, iters: int) -> dict[str, list[float]]:
    """Time every variant once per round, rotating the order, so that background load on a
    shared machine hits ours and torch's alike."""
    for fn in fns.values():  # warm-up (connections, allocator)
        fn()
        fn()
    names = list(fns)
    times = {k: [] for k in names}
    for i in range(iters):
        for k in names[i % len(names) :] + names[: i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def _bench_rank(comm, sizes, with_algos, ops=OPS, iters=None):
    torch.manual_seed(comm.rank)
    shared = local.attach(comm, None, 600.0)  # forked on one host: the members share it
    rings = local.attach(comm, None, 600.0, slot=0)  # the same, without a board
    rows = []
    for op in ops:
        for nbytes in sizes:
            x = torch.randn(nbytes // 4)
            ours, ref = _callables(op, x, comm, None)
            fns = {
                "ours": ours,
                "rings": _callables(op, x, rings, None)[0],
                "shm": _callables(op, x, shared, None)[0],
                "torch": ref,
                "copy": functools.partial(torch.empty_like(x).copy_, x),
            }
            if with_algos:
                fns.update({a: _callables(op, x, comm, a)[0] for a in ALGOS[op]})
            rows.append(
                {
                    "op": op,
                    "world": comm.size,
                    "bytes": nbytes,
                    **_time_interleaved(fns, iters or _iters(nbytes)),
                }
            )
    return rows


def _run(
    world: int, sizes: list[int], with_algos: bool, timeout_s: float, tries: int = 3, ops=OPS, iters=None
):
    """run_ranks, retried: forked ranks occasionally hang while connecting to the rendezvous
    store (before any collective runs), which run_ranks reports as a TimeoutError."""
    for attempt in range(1, tries + 1):
        try:
            return run_ranks(_bench_rank, world, sizes, with_algos, ops, iters, timeout_s=timeout_s)
        except TimeoutError as e:
            print(f"world {world}, attempt {attempt}: {e}; retrying", file=sys.stderr)
    raise RuntimeError(f"world {world}: every attempt timed out")


def _median_of_slowest(per_rank: list[list[float]]) -> float:
    return statistics.median(max(ts) for ts in zip(*per_rank)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 sizes (1 KB, 64 KB, 4 MB, 16 MB), < 1 min")
    ap.add_argument("--algos", action="store_true", help="also time each forced algorithm of ours")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="only these collectives")
    ap.add_argument(
        "--sizes", type=int, nargs="+", help="bytes (multiples of 16) instead of the default list"
    )
    ap.add_argument(
        "--iters", type=int, help="timed iterations per variant (default: 100 for the smallest sizes .. 8)"
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "collectives.json"))
    args = ap.parse_args()
    sizes = args.sizes or (
        [1 << 10, 64 << 10, 4 << 20, 16 << 20] if args.quick else [1 << (10 + 2 * i) for i in range(9)]
    )  # 1 KB .. 64 MB
    torch.set_num_threads(1)  # also keeps forked ranks clear of the parent's thread pool
    load_before = os.getloadavg()[0]
    results = []
    for world in args.worlds:
        # 8 ranks on 2 shared cores at load ~20 needed more than 120 s for --quick
        timeout_s = (40 if args.quick else 100) * world
        per_rank = _run(world, sizes, args.algos, timeout_s, ops=args.ops, iters=args.iters)
        for i, row in enumerate(per_rank[0]):
            out = {k: row[k] for k in ("op", "world", "bytes")}
            for key in row:
                if key not in out:
                    out[key + "_ms"] = _median_of_slowest([r[i][key] for r in per_rank])
            out["ratio"] = out["torch_ms"] / out["ours_ms"]
            out["shm_ratio"] = out["torch_ms"] / out["shm_ms"]
            out["shm_vs_copy"] = out["shm_ms"] / out["copy_ms"]
            results.append(out)

    extra = list(dict.fromkeys(a for op in args.ops for a in ALGOS[op])) if args.algos else []
    head = f"{'op':<15}{'world':>6}{'bytes':>10}{'ours ms':>10}{'torch ms':>10}{'ratio':>8}{'rings ms':>10}"
    head += f"{'shm ms':>10}{'ratio':>8}{'copy ms':>10}{'shm/copy':>9}{'ours = ':>14}"
    print(head + "".join(f"{a + ' ms':>11}" for a in extra))
    for r in results:
        b = r["bytes"]
        size = f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K"
        line = f"{r['op']:<15}{r['world']:>6}{size:>10}{r['ours_ms']:>10.3f}{r['torch_ms']:>10.3f}"
        line += f"{r['ratio']:>8.2f}{r['rings_ms']:>10.3f}"
        line += f"{r['shm_ms']:>10.3f}{r['shm_ratio']:>8.2f}{r['copy_ms']:>10.3f}{r['shm_vs_copy']:>9.1f}"
        print(
            f"{line}{default_algorithm(r['op'], b, r['world']):>14}"
            + "".join(f"{r[a + '_ms']:>11.3f}" if a + "_ms" in r else f"{'-':>11}" for a in extra)
        )
    path = args.out
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "quick": args.quick,
                "iters": args.iters,
                "torch": torch.__version__,
                "cores": os.cpu_count(),
                "loadavg_1min": [load_before, os.getloadavg()[0]],
                "unit": "ms, median over iterations of the slowest rank; ratio = torch / ours (over gloo), "
                "rings = ours through the segment's rings, shm_ratio = torch / ours read from its board, "
                "shm_vs_copy = shm / copy",
                "results": results,
            },
            f,
            indent=1,
        )
    print(
        f"ratio = torch ms / ours ms (> 1: ours faster); 1-min load average {load_before:.1f} -> "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\nwrote {path}"
    )


if __name__ == "__main__":
    main()
