"""dist.collectives=torch: every collective goes through torch.distributed's own (distlib/comm/native.py)
instead of our algorithms, with the same results: each collective against ours on 4 gloo ranks
(uneven and empty bounds, avg as SUM then divide, the header check), the mesh's groups inheriting
the choice, and whole runs (dp4 ZeRO-1, tp2 x dp2 ZeRO-3) whose per-step losses are within 1e-6 of
the same runs on our collectives, with torch's collectives really called (and never by ours)."""

from __future__ import annotations

import datetime
import itertools
import time

import pytest
import torch
import torch.distributed as dist
from golden_runs import _run_one as golden_rank
from multiproc import run_ranks
from trainrun import compose_tree

from distlib.comm import collectives, native
from distlib.comm.collectives import chunk_bounds
from distlib.comm.group import Comm
from distlib.comm.layout import Layout
from distlib.comm.mesh import build_mesh
from distlib.comm.p2p import CollectiveMismatchError
from distlib.comm.watchdog import StallError, watch

UNEVEN = [(0, 0), (0, 7), (7, 7), (7, 11)]  # an empty chunk first and in the middle, sizes 7 and 4
LOSS_ATOL = 1e-6
# the torch.distributed functions distlib/comm/native.py calls
TORCH_CALLS = ("all_reduce", "reduce_scatter_single", "all_gather_single", "broadcast")


def _calls(comm: Comm) -> dict[str, list]:
    """Every collective of ours, the ways the library calls them, on one rank; plain lists back."""
    x = torch.randn(11, generator=torch.Generator().manual_seed(comm.rank), dtype=torch.float64)
    lo, hi = UNEVEN[comm.rank]
    even_lo, even_hi = chunk_bounds(11, comm.size)[comm.rank]
    buf = x[:8].clone()  # all-gathered in place: each rank's chunk is its own view of the output
    out = {
        "all_reduce sum": collectives.all_reduce(x.clone(), comm, "sum"),
        "all_reduce avg": collectives.all_reduce(x.clone(), comm, "avg"),
        "all_reduce max": collectives.all_reduce(x.clone(), comm, "max"),
        "all_reduce min int64": collectives.all_reduce(torch.tensor([comm.rank + 3]), comm, "min"),
        "reduce_scatter avg even": collectives.reduce_scatter(x[:8].clone(), comm, "avg"),
        "reduce_scatter sum default split": collectives.reduce_scatter(x.clone(), comm, "sum"),
        "reduce_scatter uneven": collectives.reduce_scatter(x.clone(), comm, "sum", bounds=UNEVEN),
        "all_gather default split": collectives.all_gather(torch.zeros(11), x[even_lo:even_hi].float(), comm),
        "all_gather uneven": collectives.all_gather(torch.zeros(11), x[lo:hi].float(), comm, bounds=UNEVEN),
        "all_gather in place": collectives.all_gather(buf, buf[2 * comm.rank : 2 * comm.rank + 2], comm),
        "broadcast": collectives.broadcast(x.clone(), 2, comm),
    }
    payloads = collectives.all_gather_bytes(b"r" * comm.rank, comm)
    return {"bytes": payloads, **{name: t.tolist() for name, t in out.items()}}


def _both(comm: Comm) -> dict:
    ours = comm.instrumented(check=True)
    theirs = comm.instrumented(check=True, collectives="torch")
    return {"ours": _calls(ours), "torch": _calls(theirs), "calls": (ours.stats.calls, theirs.stats.calls)}


def test_each_collective_gives_ours_results_and_counts():
    for rank, got in enumerate(run_ranks(_both, 4)):
        assert got["ours"].pop("bytes") == got["torch"].pop("bytes") == [b"r" * j for j in range(4)]
        for name, ours in got["ours"].items():
            theirs = got["torch"][name]
            assert theirs == pytest.approx(ours, rel=0, abs=1e-12), f"rank {rank}: {name}"
        assert got["calls"][0] == got["calls"][1], "each outermost call counted once, as ours"


def _all_to_all(comm: Comm) -> list[float]:
    """Rank i sends rank j (j + 1) values i * 10 + j, and rank 2 none (pieces uneven and empty);
    the receive buffer holds the pieces in reverse rank order, so the bounds are not the packing."""
    me, n = comm.rank, comm.size
    sizes = [0 if me == 2 else j + 1 for j in range(n)]
    send = torch.cat([torch.full((k,), float(me * 10 + j)) for j, k in enumerate(sizes)])
    send_ends = list(itertools.accumulate(sizes))
    send_bounds = [(end - k, end) for end, k in zip(send_ends, sizes)]
    incoming = [0 if i == 2 else me + 1 for i in range(n)]
    recv_ends = list(itertools.accumulate(reversed(incoming)))[::-1]  # rank n-1's piece first
    recv_bounds = [(end - k, end) for end, k in zip(recv_ends, incoming)]
    recv = torch.full((sum(incoming),), -1.0)
    native.all_to_all(send, recv, comm, send_bounds, recv_bounds)
    return recv.tolist()


def test_all_to_all_delivers_each_piece_where_its_bounds_say():
    for me, got in enumerate(run_ranks(_all_to_all, 4)):
        from_each = [[] if i == 2 else [float(i * 10 + me)] * (me + 1) for i in range(4)]
        assert got == [x for piece in reversed(from_each) for x in piece], me


def _mismatched(comm: Comm) -> str:
    comm = comm.instrumented(check=True, collectives="torch")
    try:
        collectives.all_reduce(torch.zeros(4 + comm.rank % 2), comm)  # ranks 1 and 3 differ in size
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_mismatched_calls_raise_the_header_error_on_every_rank_before_torch_runs():
    for message in run_ranks(_mismatched, 4, timeout_s=30):
        assert "mismatched collective" in message and "numel=5" in message, message


def _stall(comm: Comm):
    short = dist.new_group(list(comm.ranks), timeout=datetime.timedelta(seconds=1.5))
    sub = Comm.subgroup(comm.ranks, short).instrumented(check=False, collectives="torch")
    if comm.rank == 1:
        time.sleep(5)  # never joins the all_reduce below; the others give up after 1.5 s
        return "slept"
    try:
        with watch("step 7", sub, 1.5):
            collectives.all_reduce(torch.ones(4), sub)
        return "no error"
    except StallError as exc:
        return str(exc)


def test_a_stall_in_torch_collective_is_diagnosed_like_ours():
    results = run_ranks(_stall, 3, timeout_s=60)
    assert results[1] == "slept"
    for msg in (results[0], results[2]):
        assert msg.startswith("step 7: all_reduce did not complete on rank"), msg
        assert "rank(s) [1] did not arrive" in msg and "waiting on rank None" not in msg, msg


def _mesh_choices(comm: Comm) -> dict[str, str]:
    mesh = build_mesh(comm.instrumented(check=False, collectives="torch"), Layout.of(comm.size, tp=2))
    return {name: c.collectives for name, c in {"world": mesh.world, **mesh.groups()}.items()}


def test_the_mesh_groups_inherit_the_choice():
    for choices in run_ranks(_mesh_choices, 4):
        assert choices == {"world": "torch", "dp": "torch", "tp": "torch"}


def test_an_unknown_choice_is_refused_by_the_comm():
    with pytest.raises(ValueError, match="collectives must be one of"):
        Comm(ranks=(0,), rank=0, collectives="nccl")


def _train_counting(comm: Comm, tree: dict, run_dir: str) -> dict:
    """One rank of a golden run (``golden_runs``: the Trainer as train.py runs it, any ZeRO stage),
    counting its calls of torch's own collectives."""
    counts = dict.fromkeys(TORCH_CALLS, 0)
    originals = {name: getattr(dist, name) for name in TORCH_CALLS}

    def counted(name: str):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in TORCH_CALLS:
        setattr(dist, name, counted(name))
    try:
        losses = golden_rank(comm, tree, run_dir)["losses"]
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"losses": [float.fromhex(v) for v in losses], "torch_calls": counts}


# name -> (overrides, the torch functions its collectives must call: tp adds the layers' all-reduces)
LAYOUTS = {
    "dp4_stage1": ([], ("reduce_scatter_single", "all_gather_single", "broadcast")),
    "tp2_dp2_stage3": (["dist.tp=2", "zero=stage3"], TORCH_CALLS),
}
SHORT = ["dist.world_size=4", "train.steps=8", "checkpoint.every_steps=0", "metrics.progress_every=0"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_run_on_torch_collectives_has_our_losses_within_1e_6(layout, tmp_path):
    runs = {
        choice: run_ranks(
            _train_counting,
            4,
            compose_tree([*SHORT, *LAYOUTS[layout][0], f"dist.collectives={choice}"]),
            str(tmp_path / choice),
        )[0]
        for choice in ("ours", "torch")
    }
    ours, theirs = runs["ours"]["losses"], runs["torch"]["losses"]
    assert len(ours) == len(theirs) == 8
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    assert worst <= LOSS_ATOL, f"{layout}: losses differ by up to {worst:.2e}: {ours} vs {theirs}"
    assert set(runs["ours"]["torch_calls"].values()) == {0}, "our collectives never call torch's"
    called = runs["torch"]["torch_calls"]
    assert all(called[name] > 0 for name in LAYOUTS[layout][1]), called
