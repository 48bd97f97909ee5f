"""Who says why a collective failed (distlib/launch/worker.py ``_failed``; issue #37).

A mismatch that every rank raised alike (the header check compared every member's call) is one
line, rank 0's. A failure that one rank saw alone (a message that did not fit its call: before
the all-to-all's width fix, an expert rank that got no tokens) is said by that rank, rank-prefixed,
and the rank leaves at once: the others, still waiting on it, cannot say why. Real collectives on
forked gloo ranks produce both; each rank's stderr is a file the test reads."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from multiproc import run_ranks

from distlib.comm import collectives as C
from distlib.comm.group import Comm
from distlib.comm.p2p import CollectiveMismatchError
from distlib.launch import worker


def _mismatch(comm: Comm, alone: bool) -> None:
    checked = comm.instrumented(check=True)
    if alone:  # rank 0 expects nothing from rank 1, which sends it two rows: only rank 0 can tell
        send = [0, 0] if comm.rank == 0 else [2, 0]
        recv = [0, 0] if comm.rank == 0 else [0, 0]
        C.all_to_all(torch.ones(sum(send), 3), checked, send, recv)
    elif comm.rank == 0:  # different collectives: every rank's header check sees both calls
        C.all_reduce(torch.ones(4), checked)
    else:
        C.broadcast(torch.ones(4), 0, checked)


def _report(comm: Comm, alone: bool, err_dir: str) -> str:
    """This rank's verdict from ``worker._failed``, its stderr in ``err_dir``/<rank>."""
    os.environ["RANK"] = str(comm.rank)  # as torchrun sets it
    with open(os.path.join(err_dir, str(comm.rank)), "w") as err:
        os.dup2(err.fileno(), 2)
    sys.stderr = open(2, "w", closefd=False)
    try:
        _mismatch(comm, alone)
    except CollectiveMismatchError as exc:
        return f"agreed={exc.agreed} returned {worker._failed(exc)}"
    return "no error"


def _stderr(tmp_path, rank: int) -> str:
    return (tmp_path / str(rank)).read_text()


def test_a_mismatch_every_rank_raised_is_one_line_from_rank_0(tmp_path):
    verdicts = run_ranks(_report, 2, False, str(tmp_path))
    for verdict, call in zip(verdicts, ("all_reduce", "broadcast")):  # each names its own call first
        assert verdict.startswith(f"agreed=True returned ['{call}: mismatched collective in group"), verdict
    assert _stderr(tmp_path, 0).startswith("error: all_reduce: mismatched collective in group [0, 1]")
    assert len(_stderr(tmp_path, 0).splitlines()) == 1
    assert _stderr(tmp_path, 1) == ""


def test_a_failure_one_rank_saw_alone_is_said_by_that_rank(tmp_path):
    # rank 0 prints its line and leaves (os._exit(1)) before it can report to the test: that exit
    # is the point; rank 1, whose call completed, saw nothing wrong
    with pytest.raises(AssertionError, match="rank 0 exited with code 1 without reporting"):
        run_ranks(_report, 2, True, str(tmp_path))
    lines = _stderr(tmp_path, 0).splitlines()
    assert lines == [
        "error [rank 0]: all_to_all: peers [1] sent a payload with the header that this rank never received"
    ]
    assert _stderr(tmp_path, 1) == ""
