"""reduce_scatter / all_gather with uneven, possibly empty, per-rank bounds (what ZeRO-2/3 use
to move a bucket or block straight into / out of the ranks' partitions), against torch's own."""

import torch
import torch.distributed as dist
from multiproc import run_ranks

from distlib.comm import collectives

BOUNDS = [(0, 5), (5, 5), (5, 13)]  # rank 1 owns nothing of this 13-element buffer


def _uneven(comm):
    failures = []
    for algo in ("direct", "ring", "halving", "bruck"):
        for op in ("sum", "avg"):
            t = torch.randn(13, generator=torch.Generator().manual_seed(comm.rank + 1))
            want = t.clone()
            dist.all_reduce(want)  # torch's collective is the reference
            if op == "avg":
                want /= comm.size
            lo, hi = BOUNDS[comm.rank]
            if algo == "bruck":  # an all_gather algorithm only
                continue
            got = collectives.reduce_scatter(t, comm, op=op, algo=algo, bounds=BOUNDS)
            if got.shape != (hi - lo,) or not torch.allclose(got, want[lo:hi], rtol=1e-6, atol=1e-6):
                failures.append(f"reduce_scatter {algo} {op}: {got} vs {want[lo:hi]}")
        if algo == "halving":  # a reduce_scatter algorithm only
            continue
        full = torch.zeros(13)
        mine = torch.arange(13, dtype=torch.float32)[slice(*BOUNDS[comm.rank])] * 10
        collectives.all_gather(full, mine, comm, algo=algo, bounds=BOUNDS)
        if not torch.equal(full, torch.arange(13, dtype=torch.float32) * 10):
            failures.append(f"all_gather {algo}: {full}")
    try:
        collectives.reduce_scatter(torch.zeros(13), comm, bounds=[(0, 5), (6, 13), (13, 13)])
        failures.append("non-contiguous bounds were accepted")
    except ValueError as exc:
        if "contiguous" not in str(exc):
            failures.append(f"unclear error: {exc}")
    return failures


def test_uneven_bounds_match_torch_collectives():
    assert run_ranks(_uneven, 3) == [[], [], []]
