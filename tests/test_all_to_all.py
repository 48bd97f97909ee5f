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
                    into = torch.full_like(ref, 7)  # received into, in place of a new tensor
                    back = C.all_to_all(x, checked, send_splits, given, algo=algo, out=into)
                    if back is not into or into.view(torch.uint8).ne(ref.view(torch.uint8)).any():
                        failures.append(f"case {case} {dtype} {algo} given={given is not None} out=")
            if not torch.equal(C.all_to_all(x, native, send_splits), ref):
                failures.append(f"case {case} {dtype} through torch's")
    if checked.stats.calls["all_to_all"] != 3 * len(DTYPES) * 8:
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


def _wrong_out_rank(comm: Comm) -> list[str]:
    """Every rank passes an ``out`` of the wrong shape, then of the wrong dtype: each refused
    before anything is sent, so the group's next all-to-all (with a right one) still works."""
    checked, n = comm.instrumented(check=True), comm.size
    x, lines = torch.arange(2.0 * n).view(n, 2) + 10 * comm.rank, []
    for bad in (torch.empty(n + 1, 2), torch.empty(n, 2, dtype=torch.float64)):
        try:
            C.all_to_all(x, checked, [1] * n, [1] * n, out=bad)
            lines.append("accepted")
        except ValueError as err:
            lines.append(str(err))
    into = torch.empty(n, 2)
    C.all_to_all(x, checked, [1] * n, [1] * n, out=into)
    lines.append(str(into[:, 0].tolist()))
    return lines


def test_a_wrong_out_is_refused_before_anything_is_sent():
    for rank, lines in enumerate(run_ranks(_wrong_out_rank, 2)):
        assert "of shape [2, 2] on cpu; got torch.float32 [3, 2] on cpu" in lines[0], lines
        assert "must be a torch.float32 tensor" in lines[1] and "got torch.float64" in lines[1], lines
        assert lines[2] == str([float(2 * rank), 10.0 + 2 * rank]), lines  # row `rank` of each peer
    solo = Comm((0,), 0)
    into = torch.zeros(3)
    assert C.all_to_all(torch.arange(3.0), solo, [3], out=into) is into and torch.equal(
        into, torch.arange(3.0)
    )
