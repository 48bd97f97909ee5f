"""The hand-written all-to-all (distlib/comm/collectives.py all_to_all, algorithms in
distlib/comm/algorithms/all_to_all.py) against torch's gloo ``all_to_all_single``: uneven and
empty pieces, counts exchanged or given, several dtypes, header-checked, on 2, 3 and 4 ranks."""

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks

from distlib.comm import collectives as C
from distlib.comm.group import Comm
from distlib.comm.p2p import CollectiveMismatchError

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _splits(me: int, n: int, case: int) -> list[int]:
    """Rows rank ``me`` sends each rank: uneven, some empty (never all of one rank's)."""
    return [(3 * me + 5 * j + case) % 4 for j in range(n)]


def _rank(comm: Comm) -> list[str]:
    n, me, failures = comm.size, comm.rank, []
    checked = comm.instrumented(check=True)
    native = comm.instrumented(check=True, collectives="torch")  # dist.collectives=torch: the same call
    for case in range(3):
        for dtype in DTYPES:
            send_splits = _splits(me, n, case)
            gen = torch.Generator().manual_seed(100 * me + case)
            x = (torch.randn(sum(send_splits), 3, generator=gen) * 100).to(dtype)
            recv_splits = [_splits(j, n, case)[me] for j in range(n)]
            ref = torch.empty(sum(recv_splits), 3, dtype=dtype)
            dist.all_to_all_single(ref, x, recv_splits, send_splits)
            for algo in ("direct", "pairwise"):
                for given in (None, recv_splits):
                    got = C.all_to_all(x, checked, send_splits, given, algo=algo)
                    if got.shape != ref.shape or got.view(torch.uint8).ne(ref.view(torch.uint8)).any():
                        failures.append(f"case {case} {dtype} {algo} given={given is not None}")
            if not torch.equal(C.all_to_all(x, native, send_splits), ref):
                failures.append(f"case {case} {dtype} through torch's")
    if checked.stats.calls["all_to_all"] != 3 * len(DTYPES) * 4:
        failures.append(f"counted {checked.stats.calls['all_to_all']} all_to_all calls")
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_algorithm_delivers_torchs_bytes(world):
    for rank, failures in enumerate(run_ranks(_rank, world)):
        assert failures == [], f"rank {rank}: {failures}"


def _mismatch_rank(comm: Comm) -> str:
    checked = comm.instrumented(check=True)
    try:
        if comm.rank == 0:
            C.all_reduce(torch.ones(4), checked)
        else:
            C.all_to_all(torch.ones(4, 2), checked, [1] * (comm.size - 1) + [5 - comm.size])
    except CollectiveMismatchError as err:
        return str(err).splitlines()[0]
    return "no error"


def test_a_rank_calling_another_collective_fails_on_every_rank():
    lines = run_ranks(_mismatch_rank, 3)
    assert all("mismatched collective" in line for line in lines), lines


def test_bad_splits_are_one_line():
    solo = Comm((0,), 0)
    with pytest.raises(ValueError, match=r"send_splits \[2\] must be 1 counts >= 0 adding to 3"):
        C.all_to_all(torch.ones(3, 2), solo, [2])
    with pytest.raises(ValueError, match="unknown all_to_all algorithm 'ring'"):
        C.all_to_all(torch.ones(3), solo, [3], algo="ring")
    assert torch.equal(C.all_to_all(torch.arange(3.0), solo, [3]), torch.arange(3.0))
