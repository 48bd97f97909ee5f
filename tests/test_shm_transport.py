"""The shared-memory transport (distlib/comm/shm.py) against gloo's pairs, on real forked ranks.

Every collective and algorithm runs twice in the same ranks, once over gloo and once over the
segment, and must leave the same bytes (the algorithms are the same; only the carrier differs):
uneven and empty parts, each root, the header check on and off, and rings far smaller than the
messages, so every message streams through and wraps around many times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks

from distlib.app.config.run import RunConfig
from distlib.app.trainer import Trainer
from distlib.comm import collectives as C
from distlib.comm import local, shm
from distlib.comm.group import Comm
from distlib.comm.header import HEADER_BYTES, INLINE_BYTES
from distlib.comm.layout import Layout
from distlib.comm.mesh import build_mesh
from distlib.comm.p2p import P2P, CollectiveError
from distlib.launch.hydra_config import compose_tree
from distlib.launch.torchrun import use_deterministic_kernels

AR_ALGOS = ("exchange", "direct", "ring", "rabenseifner")
RS_ALGOS, AG_ALGOS = ("direct", "ring", "halving"), ("direct", "ring", "bruck")
BCAST_ALGOS = ("flat", "tree", "chain", "scatter")


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _uneven(numel: int, n: int, salt: int) -> list[tuple[int, int]]:
    """A split with empty parts (every third rank, shifted by salt) and the rest uneven."""
    weights = [0 if (j + salt) % 3 == 0 else j + 1 for j in range(n)]
    if not any(weights):
        weights[-1] = 1
    cuts, acc = [0], 0
    for w in weights:
        acc += w
        cuts.append(numel * acc // sum(weights))
    return list(zip(cuts[:-1], cuts[1:]))


def _battery(comm: Comm) -> dict[str, str]:
    """Every collective x algorithm on ``comm``: {case: sha256 of what this rank holds}."""
    out: dict[str, str] = {}
    me, n = comm.rank, comm.size
    for numel in (0, 1, 7, 1000, 4099):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(97 * me + numel))
        for algo in AR_ALGOS:
            for op in ("sum", "max"):
                out[f"all_reduce/{algo}/{op}/{numel}"] = _digest(C.all_reduce(x.clone(), comm, op, algo=algo))
        for salt, bounds in enumerate((None, _uneven(numel, n, 0), _uneven(numel, n, 1))):
            for algo in RS_ALGOS:
                got = C.reduce_scatter(x, comm, algo=algo, bounds=bounds)
                out[f"reduce_scatter/{algo}/{salt}/{numel}"] = _digest(got)
            for algo in AG_ALGOS:
                spans = bounds or C.chunk_bounds(numel, n)
                full = torch.zeros(numel)
                C.all_gather(full, x[slice(*spans[me])], comm, algo=algo, bounds=bounds)
                out[f"all_gather/{algo}/{salt}/{numel}"] = _digest(full)
        for algo in BCAST_ALGOS:
            for src in range(n):
                out[f"broadcast/{algo}/{src}/{numel}"] = _digest(C.broadcast(x.clone(), src, comm, algo=algo))
    for algo in ("direct", "pairwise"):
        for case, splits in enumerate(([0] * n, [(me + j) % 3 for j in range(n)], [5 * j for j in range(n)])):
            rows = torch.randn(sum(splits), 3, generator=torch.Generator().manual_seed(me))
            out[f"all_to_all/{algo}/{case}"] = _digest(C.all_to_all(rows, comm, splits, algo=algo))
    return out


# (header check, board slot): no board (every collective by messages through the rings) checked
# and not; slots of 192 bytes (every message of more than 48 floats in rounds, all_reduce above
# that in its two-barrier shape); the default slot (one round each here, all_reduce in one
# barrier). On the board the check only adds the header to the first barrier: checked is enough.
CARRIERS = ((False, 0), (True, 0), (True, 192), (True, None))


def _both_transports(comm: Comm, capacity: int) -> list[tuple[str, str, str]]:
    """Cases whose bytes differ between gloo and the segment (its rings, its board), with the
    header check off and on."""
    C.SEGMENT_BYTES = 256  # pipelined algorithms: many segments per message
    differ = []
    wants = {check: _battery(dataclasses.replace(comm, check=check)) for check in (False, True)}
    for check, slot in CARRIERS:
        gloo = dataclasses.replace(comm, check=check)
        ours = local.attach(gloo, None, 60.0, capacity=capacity, slot=slot)
        assert ours.transport is not None and (ours.transport.board is None) == (slot == 0)
        want, got = wants[check], _battery(ours)
        assert want.keys() == got.keys()
        differ += [(f"{check} {slot}", case, got[case]) for case in want if got[case] != want[case]]
        assert ours.transport.pending() == 0  # every message posted went through
    return differ


@pytest.mark.parametrize("world,capacity", [(2, 64), (3, 1 << 20), (4, 4096), (5, 200)])
def test_every_collective_matches_gloo_bitwise(world, capacity):
    for differ in run_ranks(_both_transports, world, capacity, timeout_s=240):
        assert differ == []


def _message_sizes(comm: Comm) -> dict:
    ours = local.attach(comm, None, 60.0)
    p2p = P2P("test", ours)
    if comm.rank == 0:
        p2p.wait(p2p.send(torch.arange(5, dtype=torch.uint8), 1))  # shorter than its receive
        p2p.send(torch.arange(100, dtype=torch.uint8), 1)  # longer than its receive: in the ring whole
        return {}
    got = torch.full((9,), 255, dtype=torch.uint8)
    p2p.wait(p2p.recv(got, 0))
    try:
        p2p.wait(p2p.recv(torch.empty(50, dtype=torch.uint8), 0))
    except CollectiveError as exc:
        return {"got": got.tolist(), "error": str(exc), "peer": exc.peer}
    return {"got": got.tolist(), "error": None}


def test_a_short_message_fills_part_of_its_receive_and_a_long_one_is_an_error():
    # gloo fills part of a longer receive (the header check relies on it) and aborts the process on
    # a longer message; the segment does the first and raises a CollectiveError for the second
    result = run_ranks(_message_sizes, 2)[1]
    assert result["got"] == [0, 1, 2, 3, 4, 255, 255, 255, 255]
    assert result["error"] is not None and result["peer"] == 0
    assert "100 bytes arrived for a receive of 50" in result["error"], result["error"]


def _killed(comm: Comm, shm_dir: str, out: str) -> None:
    os.environ["DISTLIB_SHM_DIR"] = shm_dir
    ours = local.attach(comm, None, 60.0)
    left = sorted(os.listdir(shm_dir))  # the creator's attach unlinked it: nothing on disk now
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies before its part of the collective
    waited, exc = _failed_all_reduce(ours)
    if exc is not None:
        Path(out, f"rank{comm.rank}").write_text(f"{waited}\n{exc.peer}\n{left}\n{exc}")


def _failed_all_reduce(comm: Comm) -> tuple[float, CollectiveError | None]:
    """An all_reduce over ``comm``: (seconds it took, the error it raised or None)."""
    began = time.monotonic()
    try:
        C.all_reduce(torch.ones(1000), comm)
    except CollectiveError as exc:
        return time.monotonic() - began, exc
    return time.monotonic() - began, None


def test_a_rank_killed_mid_collective_is_named_at_once_and_nothing_is_left(tmp_path):
    shm_dir, out = tmp_path / "shm", tmp_path / "out"
    shm_dir.mkdir()
    out.mkdir()
    with pytest.raises(AssertionError, match="rank 1 exited"):
        run_ranks(_killed, 3, str(shm_dir), str(out), timeout_s=60)
    peers = []
    for rank in (0, 2):
        waited, peer, left, message = (out / f"rank{rank}").read_text().split("\n", 3)
        assert float(waited) < 5.0, message  # the 60 s timeout is not waited out
        assert left == "[]" or rank != 0  # (the others may look before it unlinks)
        # a survivor may wait on the dead rank itself, or on the other survivor once it has left
        assert "has exited" in message, message
        peers.append(int(peer))
    assert 1 in peers
    assert os.listdir(shm_dir) == []


def _left(comm: Comm, out: str) -> None:
    ours = local.attach(comm, None, 30.0)
    if comm.rank == 1:
        shm.leave_all()  # as a survivor of a lost peer does before it re-forms its groups
        time.sleep(3.0)  # alive all along: only its mark tells the others it is gone
        return
    waited, exc = _failed_all_reduce(ours)
    if exc is not None:
        Path(out, f"rank{comm.rank}").write_text(f"{waited}\n{exc}")


def test_a_live_rank_that_left_its_segment_fails_its_peers_waits_at_once(tmp_path):
    run_ranks(_left, 3, str(tmp_path), timeout_s=60)
    for rank in (0, 2):
        waited, message = (tmp_path / f"rank{rank}").read_text().split("\n", 1)
        assert float(waited) < 2.5, message  # not the 30 s timeout, and before rank 1 exits
        assert "left the group" in message, message


def test_a_segment_whose_creator_died_is_reaped(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLIB_SHM_DIR", str(tmp_path))
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    stale = tmp_path / f"{local.PREFIX}{dead}-0123456789ab"
    alive = tmp_path / f"{local.PREFIX}{os.getpid()}-0123456789ab"
    other = tmp_path / "someone-elses"
    for path in (stale, alive, other):
        path.write_bytes(b"x")
    path = local.create(2, 64)
    assert path and not stale.exists() and alive.exists() and other.exists()


def _which(comm: Comm, hosts: list[str]) -> bool:
    return local.attach(comm, hosts, 60.0).transport is not None


def test_only_a_group_on_one_host_gets_a_segment():
    assert run_ranks(_which, 2, ["a", "a"]) == [True, True]
    assert run_ranks(_which, 2, ["a", "b"]) == [False, False]  # two hosts: gloo's pairs


def test_bad_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        local.create(2, 100)
    for slot in (-64, 100, 64):  # negative, not whole lines, under 8 bytes for each of 9 members
        with pytest.raises(ValueError, match="board slot"):
            local.create(9, 64, slot)


def _train_both(comm: Comm, root: str) -> dict:
    use_deterministic_kernels()
    out = {}
    for transport in ("shm", "gloo"):
        chosen = [] if transport == "shm" else ["dist.transport=gloo"]  # shm: the default
        tree = compose_tree(
            ["dist.tp=2", "zero=stage3", "train.steps=4", "metrics.progress_every=0", *chosen]
        )
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            trainer = Trainer(RunConfig.from_dict(tree), comm, Path(root) / transport)
            result = trainer.run()
        groups = {"world": trainer.comm, **trainer.mesh.groups()}
        out[transport] = {
            "losses": [s.loss.hex() for s in result.steps],
            "params": trainer.optimizer.full_params().numpy().tobytes(),
            "segments": sorted(name for name, g in groups.items() if g.transport is not None),
        }
    return out


def test_a_training_run_uses_segments_by_default_with_the_same_bytes_as_gloo(tmp_path):
    got = run_ranks(_train_both, 4, str(tmp_path), timeout_s=240)
    for rank in got:
        assert rank["shm"]["segments"] == ["dp", "tp", "world"]  # every group of the mesh
        assert rank["gloo"]["segments"] == []
        assert len(rank["shm"]["losses"]) == 4
        assert rank["shm"]["losses"] == rank["gloo"]["losses"]
        assert rank["shm"]["params"] == rank["gloo"]["params"]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 16, 33, 64, 128])
def test_ring_sizes_fit_every_header_message_and_keep_a_segment_near_its_budget(n):
    capacity = local.capacity_for(n)
    assert capacity % 8 == 0 and capacity <= local.CAPACITY
    assert capacity >= HEADER_BYTES + INLINE_BYTES + 8  # a header message never waits in a ring
    rings = n * (n - 1)
    if capacity > local.MIN_CAPACITY:
        assert rings * capacity <= local.SEGMENT_BUDGET
    assert (capacity == local.CAPACITY) == (n <= 8)


def _mesh_on_two_hosts(comm: Comm) -> dict:
    mesh = build_mesh(comm, Layout.of(comm.size, tp=2), 60.0, hosts=["a", "a", "b", "b"])
    x = torch.full((5,), float(comm.rank))
    C.all_reduce(x, mesh.tp)  # over the node's segment
    C.all_reduce(x, mesh.dp)  # across the two "hosts": gloo's pairs
    return {"tp": mesh.tp.transport is not None, "dp": mesh.dp.transport is not None, "x": x.tolist()}


def test_on_several_hosts_only_the_groups_inside_one_get_a_segment():
    for got in run_ranks(_mesh_on_two_hosts, 4):
        assert (got["tp"], got["dp"]) == (True, False)  # tp pairs {0, 1}, {2, 3}; dp pairs {0, 2}, {1, 3}
        assert got["x"] == [6.0] * 5  # (0 + 1) + (2 + 3)


def _torch_collectives(comm: Comm) -> dict:
    ours = dataclasses.replace(local.attach(comm, None, 60.0), collectives="torch")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(comm.rank))
    want = x.clone()
    torch.distributed.all_reduce(want)
    got = C.all_reduce(x.clone(), ours)
    written = {j: ring.head.value for j, ring in ours.transport.out.items()}  # bytes ever sent
    return {"equal": torch.equal(got, want), "messages": written}


def test_torch_collectives_leave_the_segment_unused():
    for got in run_ranks(_torch_collectives, 3):
        assert got["equal"]  # torch's own all_reduce on the group's gloo process group: its bytes
        assert set(got["messages"].values()) == {0}  # not a byte went through a ring


def _without_segment(comm: Comm, shm_dir: str, failing_rank: int) -> dict:
    os.environ["DISTLIB_SHM_DIR"] = shm_dir
    if comm.rank == failing_rank:  # this member alone cannot map the segment

        def refuse(*_):
            raise PermissionError(13, "Permission denied")

        local.open_segment = refuse
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        got = local.attach(comm, None, 60.0)
    x = torch.full((3,), float(comm.rank))
    C.all_reduce(x, got)  # the group still works, over gloo
    return {"segment": got.transport is not None, "said": said.getvalue(), "x": x.tolist()}


@pytest.mark.parametrize("case", ["no directory", "one rank cannot map it"])
def test_without_a_segment_the_group_keeps_gloo_and_says_why(tmp_path, case):
    where = str(tmp_path / "missing") if case == "no directory" else str(tmp_path)
    got = run_ranks(_without_segment, 3, where, -1 if case == "no directory" else 2)
    assert [g["segment"] for g in got] == [False] * 3
    assert all(g["x"] == [3.0] * 3 for g in got)
    want = "no segment could be created in" if case == "no directory" else "rank 2 could not map"
    assert want in got[0]["said"] and "group [0, 1, 2] uses gloo" in got[0]["said"], got[0]["said"]
    assert os.listdir(tmp_path) == []  # (the directory case: nothing was made at all)
