"""Property tests for every collective that takes splits, at world sizes 2-5, with uneven and
empty parts: seeded random split matrices, and the shapes that broke expert parallelism (issue
#37: a rank whose experts got no tokens sends nothing back, yet must receive its own tokens'
outputs) -- a rank that sends nothing, one that receives nothing, one with neither, an all-zero
matrix, a single non-empty piece -- on 1-D, 2-D and 3-D rows.

Each is checked against torch's own gloo collective on the same inputs: all_to_all (direct,
pairwise, and ``dist.collectives=torch``; counts given or exchanged; header-checked and not),
forward and the autograd backward of ``expert_parallel.exchange``; reduce_scatter and all_gather
with uneven ``bounds`` (every algorithm and torch's), and all_gather_bytes with empty payloads.
The values are integers (in float32 too), so every reduction order gives the same bytes and the
comparison is bitwise."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks

from distlib.comm import collectives as C
from distlib.comm.group import Comm
from distlib.parallel.expert_parallel import exchange

ROWS = [(), (3,), (2, 3)]  # the trailing shape of a row: 1-D, 2-D and 3-D tensors
SEEDS = range(4)  # random matrices per world size, beside the named shapes


def matrices(n: int) -> dict[str, list[list[int]]]:
    """Named split matrices for ``n`` ranks: ``m[i][j]`` rows rank i sends rank j."""
    out = {}
    for seed in SEEDS:
        rng = random.Random(1000 * n + seed)
        out[f"random{seed}"] = [[rng.choice([0, 0, 1, 2, 5]) for _ in range(n)] for _ in range(n)]
    base = out["random0"]
    silent, deaf, both = 1 % n, (n - 1), n // 2
    out["sends nothing"] = [[0] * n if i == silent else [v + 1 for v in row] for i, row in enumerate(base)]
    out["receives nothing"] = [[0 if j == deaf else v + 1 for j, v in enumerate(row)] for row in base]
    out["neither"] = [
        [0 if both in (i, j) else v + 1 for j, v in enumerate(row)] for i, row in enumerate(base)
    ]
    out["all zero"] = [[0] * n for _ in range(n)]
    out["one piece"] = [[3 if (i, j) == (0, n - 1) else 0 for j in range(n)] for i in range(n)]
    return out


def test_the_named_matrices_have_the_shapes_they_claim():
    for n in range(2, 6):
        m = matrices(n)
        assert any(sum(row) == 0 for row in m["sends nothing"]), n
        assert any(sum(col) == 0 for col in zip(*m["receives nothing"])), n
        k = n // 2
        assert sum(m["neither"][k]) == 0 and sum(row[k] for row in m["neither"]) == 0, n
        assert all(sum(row) > 0 for i, row in enumerate(m["neither"]) if i != k), n
        assert sum(map(sum, m["all zero"])) == 0 and sum(map(sum, m["one piece"])) == 3


def _values(rows: int, row: tuple, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, (rows, *row), generator=gen).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _torch_all_to_all(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send)
    return out


def _all_to_all_rank(comm: Comm) -> list[str]:
    n, me, failures = comm.size, comm.rank, []
    comms = {
        "direct": (comm.instrumented(check=True), "direct"),
        "pairwise": (comm.instrumented(check=True), "pairwise"),
        "unchecked": (comm.instrumented(check=False), "direct"),
        "torch": (comm.instrumented(check=True, collectives="torch"), None),
    }
    for name, m in matrices(n).items():
        send, recv = m[me], [m[i][me] for i in range(n)]
        for shape in ROWS:
            x = _values(sum(send), shape, 7 * me + len(shape))
            want = _torch_all_to_all(x, send, recv)
            grad_out = _values(sum(recv), shape, 100 + me)
            want_grad = _torch_all_to_all(grad_out, recv, send)
            for label, (c, algo) in comms.items():
                for given in (recv, None):
                    got = C.all_to_all(x, c, send, given, algo=algo)
                    if not _same(got, want):
                        failures.append(f"{name} rows{shape} {label} given={given is not None}: forward")
                leaf = x.clone().requires_grad_()
                exchange(leaf, c, send, recv).backward(grad_out)
                if not _same(leaf.grad, want_grad):
                    failures.append(f"{name} rows{shape} {label}: backward")
    return failures


def _no_failures(fn, world: int) -> None:
    for rank, failures in enumerate(run_ranks(fn, world)):
        assert failures == [], f"rank {rank}: {failures}"


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_all_to_all_with_empty_parts_delivers_torchs_bytes_both_ways(world):
    _no_failures(_all_to_all_rank, world)


def bounds_cases(n: int, numel: int) -> dict[str, list[tuple[int, int]]]:
    """Named (start, end) per rank covering [0, numel): random cuts (empty parts likely), all to
    one rank, all to the last, and, for numel 0, every part empty."""
    out = {}
    for seed in SEEDS:
        rng = random.Random(77 * n + seed)
        cuts = sorted(rng.choice([0, numel, rng.randrange(numel + 1)]) for _ in range(n - 1))
        ends = [0, *cuts, numel]
        out[f"random{seed}"] = list(zip(ends[:-1], ends[1:]))
    out["first owns all"] = [(0, numel)] + [(numel, numel)] * (n - 1)
    out["last owns all"] = [(0, 0)] * (n - 1) + [(0, numel)]
    return out


RS_ALGOS = ("direct", "ring", "halving", None)  # None: dist.collectives=torch
AG_ALGOS = ("direct", "ring", "bruck", None)


def _bounds_rank(comm: Comm) -> list[str]:
    n, me, failures = comm.size, comm.rank, []
    for numel in (0, 1, 11):
        for name, bounds in bounds_cases(n, numel).items():
            lo, hi = bounds[me]
            for dtype in (torch.float32, torch.int64):
                t = _values(numel, (), 3 * me + numel, dtype)
                total = t.clone()
                dist.all_reduce(total)  # torch's reduction is the reference (integers: exact)
                for algo in RS_ALGOS:
                    c = comm.instrumented(check=True, collectives="torch" if algo is None else "ours")
                    got = C.reduce_scatter(t, c, algo=algo, bounds=bounds)
                    if not _same(got, total[lo:hi]):
                        failures.append(f"reduce_scatter {algo} numel={numel} {name} {dtype}")
                full = _values(numel, (), 5 + numel, dtype)  # the same on every rank
                for algo in AG_ALGOS:
                    c = comm.instrumented(check=True, collectives="torch" if algo is None else "ours")
                    out = torch.zeros_like(full)
                    C.all_gather(out, full[lo:hi].clone(), c, algo=algo, bounds=bounds)
                    if not _same(out, full):
                        failures.append(f"all_gather {algo} numel={numel} {name} {dtype}")
    return failures


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_reduce_scatter_and_all_gather_with_empty_parts_match_torch(world):
    _no_failures(_bounds_rank, world)


def _bytes_rank(comm: Comm) -> list[str]:
    n, me, failures = comm.size, comm.rank, []
    cases = {
        "every payload empty": [b""] * n,
        "one empty": [b"" if j == 1 % n else bytes([j]) * (j + 2) for j in range(n)],
        "one non-empty": [b"xyz" if j == n - 1 else b"" for j in range(n)],
    }
    for name, payloads in cases.items():
        for check in (True, False):
            got = C.all_gather_bytes(payloads[me], comm.instrumented(check=check))
            want: list = [None] * n
            dist.all_gather_object(want, payloads[me])
            if got != want or got != payloads:
                failures.append(f"{name} check={check}: {got}")
    return failures


@pytest.mark.parametrize("world", [2, 5])
def test_all_gather_bytes_with_empty_payloads_matches_torch(world):
    _no_failures(_bytes_rank, world)
