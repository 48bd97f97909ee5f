"""The board of a shared-memory group (distlib/comm/board.py, algorithms/reads.py) beyond equal
bytes (tests/test_shm_transport.py compares every collective with gloo's): the header check
through it, counts that disagree, a message still streaming when a collective begins, and which
order each algorithm's sums take."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from multiproc import run_ranks

from distlib.comm import collectives as C
from distlib.comm import local
from distlib.comm.algorithms import reads
from distlib.comm.group import Comm
from distlib.comm.p2p import P2P, CollectiveMismatchError


def _mismatch(comm: Comm) -> dict:
    ours = local.attach(dataclasses.replace(comm, check=True), None, 60.0)
    assert reads.board(ours) is not None
    result = {}
    try:
        if comm.rank == 1:
            C.broadcast(torch.ones(10), 0, ours)
        else:
            C.all_reduce(torch.ones(10), ours)
    except CollectiveMismatchError as exc:
        result["error"], result["agreed"] = str(exc), exc.agreed
    # the group is still usable, and the next call's header is checked again
    result["after"] = C.all_reduce(torch.full((5,), float(comm.rank)), ours).tolist()
    return result


def test_ranks_calling_different_collectives_all_raise_the_same_error_and_the_group_goes_on():
    results = run_ranks(_mismatch, 3)
    # every rank describes every rank's call alike (after its own call's name)
    assert len({r["error"].split(": ", 1)[1] for r in results}) == 1, results
    assert all(r["agreed"] for r in results)
    assert "broadcast" in results[0]["error"] and "all_reduce" in results[0]["error"]
    assert all(r["after"] == [3.0] * 5 for r in results)


def _counts_disagree(comm: Comm) -> str:
    ours = local.attach(comm, None, 60.0)
    rows = torch.ones(3, 2)
    send = [1, 2] if comm.rank == 0 else [2, 1]
    recv = [1, 1] if comm.rank == 0 else [2, 1]  # rank 0 expects 1 row from rank 1, which sends 2
    try:
        C.all_to_all(rows, ours, send, recv)
    except CollectiveMismatchError as exc:
        return str(exc)
    return ""


def test_an_all_to_all_whose_counts_disagree_is_refused_by_the_rank_that_sees_it():
    said = run_ranks(_counts_disagree, 2)
    assert said[0] == "all_to_all: group rank 1 sends 4 elements to rank 0, which expects 2", said
    assert said[1] == ""


def _streaming(comm: Comm) -> list:
    ours = local.attach(comm, None, 60.0, capacity=64)
    p2p = P2P("test", ours)
    big = torch.arange(1000, dtype=torch.float32)
    if comm.rank == 0:
        p2p.send(big, 1)  # 4000 bytes through a 64-byte ring: most of it waits on this rank
    else:
        got = torch.empty(1000)
        p2p.wait(p2p.recv(got, 0))
        assert torch.equal(got, big)
    # rank 0 is at the board's barrier while its message still streams: the barrier moves it
    return C.all_reduce(torch.ones(4), ours).tolist()


def test_a_barrier_keeps_moving_a_message_the_peer_still_receives():
    assert run_ranks(_streaming, 2, timeout_s=60) == [[2.0] * 4] * 2


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16])
def test_each_order_adds_every_member_once_in_its_algorithms_shape(n):
    def leaves(tree):
        return [tree] if isinstance(tree, int) else leaves(tree[0]) + leaves(tree[1])

    for algo in reads.ORDERS:
        for owner, tree in enumerate(reads.trees(algo, n)):
            assert sorted(leaves(tree)) == list(range(n)), (algo, owner, tree)
    # the shapes, against the message algorithms' own descriptions
    assert reads.trees("direct", 3)[0] == ((0, 1), 2)  # rank order
    assert reads.trees("ring", 3)[1] == ((2, 0), 1)  # starts right of the owner, ends on it
    assert reads.trees("halving", 4)[0] == ((0, 2), (1, 3))  # widest distance first
    assert reads.trees("halving", 3)[0] == ((0, 1), 2)  # rank 0 folded into rank 1 first
