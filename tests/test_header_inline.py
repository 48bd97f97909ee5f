"""The header check rides in the payload messages (distlib/comm/header.py ``Gate``): every
algorithm gives the same bytes checked or not, small and large payloads; a mismatch raises the
same error on every rank without aborting, and leaves nothing posted (the group stays usable)."""

import pytest
import torch
from multiproc import run_ranks

from distlib.comm import collectives
from distlib.comm.header import INLINE_BYTES
from distlib.comm.p2p import CollectiveMismatchError

SMALL, LARGE = 5, INLINE_BYTES // 4 + 3000  # floats: inlined / sent after the header


def _every_algorithm(comm, numel, check):
    comm = comm.instrumented(check=check)
    g = torch.Generator().manual_seed(comm.rank)
    out = []
    for algo in ("exchange", "direct", "ring", "rabenseifner"):
        t = torch.randn(numel, generator=g)
        out.append(collectives.all_reduce(t, comm, algo=algo))
    for rs, algo in (("direct", "direct"), ("ring", "ring"), ("halving", "bruck")):
        x = torch.randn(numel, generator=g)
        out.append(collectives.reduce_scatter(x, comm, algo=rs))
        full = torch.zeros(numel)
        bounds = collectives.chunk_bounds(numel, comm.size)
        out.append(collectives.all_gather(full, x[slice(*bounds[comm.rank])], comm, algo=algo))
    for algo in ("flat", "tree", "chain", "scatter"):
        out.append(collectives.broadcast(torch.randn(numel, generator=g), comm.size - 1, comm, algo=algo))
    out.append(torch.tensor(list(b"".join(collectives.all_gather_bytes(b"x" * (comm.rank + 1), comm)))))
    return [t.tolist() for t in out], comm.stats.total_calls


@pytest.mark.parametrize("numel", [SMALL, LARGE])
def test_checked_collectives_are_bitwise_the_unchecked_ones(numel):
    checked = run_ranks(_every_algorithm, 3, numel, True)
    assert checked == run_ranks(_every_algorithm, 3, numel, False)


def _large_mismatch(comm):
    comm = comm.instrumented(check=True)
    n = 3 * LARGE + (3 if comm.rank == 1 else 0)  # rank 1's chunks are larger than expected
    try:
        collectives.all_gather(torch.zeros(n), torch.ones(n // 3), comm, algo="ring")
        message = "no error"
    except CollectiveMismatchError as exc:
        message = str(exc)
    t = torch.ones(LARGE)  # nothing left posted: the next collective works
    collectives.all_reduce(t, comm)
    return message, t[0].item()


def test_a_large_mismatch_raises_everywhere_and_the_group_stays_usable():
    for message, after in run_ranks(_large_mismatch, 3, timeout_s=30):
        assert "mismatched collective" in message and f"all_gather(numel={3 * LARGE + 3}" in message, message
        assert after == 3.0


def _many_checked(comm, calls):
    import torch.distributed as dist

    from distlib.comm.group import Comm
    from distlib.comm.header import deliver_sent, unwaited_sends
    from distlib.comm.progress import Progress

    world = comm.instrumented(check=True)
    pair_ranks = (0, 1)
    group = dist.new_group(list(pair_ranks))  # every rank calls new_group
    pair = None
    if comm.rank in pair_ranks:
        pair = Comm(pair_ranks, pair_ranks.index(comm.rank), group).instrumented(check=True)
    held, total = [], 0.0
    for i in range(calls):
        t = torch.full((SMALL if i % 2 else LARGE,), float(comm.rank + i))
        collectives.all_reduce(t, world)
        total += t[0].item()
        if pair is not None:
            progress = Progress(pair)  # the overlap thread runs some of them
            progress.submit(collectives.all_reduce, torch.ones(SMALL), pair)
            progress.drain()
        held.append(unwaited_sends())
    deliver_sent()  # what a rank does before it leaves: every header it sent has been received
    return held, total, unwaited_sends()


def test_header_sends_are_held_for_one_collective_per_group_only():
    """A checked collective keeps its header sends until the group's next one closes: a run of
    any length holds at most (size - 1) per group, not one per peer per collective ever made."""
    calls = 60
    for rank, (held, total, left) in enumerate(run_ranks(_many_checked, 3, calls, timeout_s=60)):
        assert left == 0, rank
        assert total == sum(3 * i + 3 for i in range(calls)), rank
        assert max(held) <= 2 + (1 if rank < 2 else 0), (rank, max(held))
        assert held[-1] == held[1] > 0, rank
