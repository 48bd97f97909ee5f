"""One number per start of a job on every node (distlib/launch/torchrun.py job_attempt).

torchrun counts restarts per node: when node B's workers die while node A's are still healthy,
A's agent restarts its workers as a "membership change" and does not count it. The two nodes'
TORCHELASTIC_RESTART_COUNT then differ (A 0, B 1), and a key prefix built from it splits the
restarted job in two (the 2x2 multinode job hung this way in CI). Here two real torchrun agents
on this host (c10d rendezvous, one worker each) produce exactly that: B's first worker exits
with an error, A's sleeps; the second start must form one process group."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from forkrun import call_in_fork

from distlib.launch.torchrun import StartError, agree_start

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent("""
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    from distlib.launch.torchrun import init_process_group, join_job_start
    token, attempt = join_job_start(30)
    node, count = os.environ["NODE_TAG"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"node {node}: restart count {count}, attempt {attempt}", flush=True)
    if attempt == 0:
        if node == "b":
            sys.exit(3)            # B's worker dies: its agent counts a restart
        time.sleep(60)             # A's stays healthy: its agent restarts it uncounted
        sys.exit(4)
    init_process_group("gloo", datetime.timedelta(seconds=20))
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"node {node}: group formed, sum {t.item():g}", flush=True)
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_restart_the_nodes_count_differently_still_forms_one_group(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    procs = {}
    for node in "ab":
        env = {**os.environ, "NODE_TAG": node, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs[node] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                tmp_path.name,
                "--max-restarts",
                "1",
                "--monitor-interval",
                "0.2",
                str(script),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    outs = {}
    try:
        for node, proc in procs.items():
            outs[node] = proc.communicate(timeout=150)[0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.communicate()
    everything = "\n".join(f"--- node {n}\n{o}" for n, o in outs.items())
    # the situation itself: the per-node counts disagree on the second start ...
    assert "node a: restart count 0, attempt 1" in outs["a"], everything
    assert "node b: restart count 1, attempt 1" in outs["b"], everything
    # ... and one group of two still formed and both agents succeeded
    assert "node a: group formed, sum 2" in outs["a"] and "node b: group formed, sum 2" in outs["b"], (
        everything
    )
    assert procs["a"].returncode == 0 and procs["b"].returncode == 0, everything


# The scenarios below run threads and a store server: each runs in a forked child (call_in_fork),
# never in the test process, which forks ranks for later tests (tests/multiproc.py).


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))


def _run_ranks(
    store: dist.TCPStore, world: int, first: list[int], timeout_s: float = 5.0, absent: tuple[int, ...] = ()
) -> dict:
    """agree_start on a thread per rank (ranks in `first` start 0.3 s before the others, those in
    `absent` never)."""
    results = {}

    def rank_main(rank: int) -> None:
        if rank not in first:
            time.sleep(0.3)
        client = dist.TCPStore(
            "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        try:
            results[rank] = agree_start(client, rank, world, restart_count=0, timeout_s=timeout_s)
        except StartError as exc:
            results[rank] = f"StartError: {exc}"

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world) if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def _two_starts() -> tuple[dict, dict]:
    store = _store()
    first = _run_ranks(store, 3, first=[0])
    # the second start's ranks 1 and 2 come first and read start 0's leader (with its admission list)
    return first, _run_ranks(store, 3, first=[1, 2])


def test_stale_keys_of_a_finished_start_do_not_pull_a_rank_into_it():
    first, second = call_in_fork(_two_starts)
    assert len({token for token, _ in first.values()}) == 1 and {a for _, a in first.values()} == {0}, first
    tokens = {token for token, _ in second.values()}
    assert len(tokens) == 1 and tokens.isdisjoint(t for t, _ in first.values()), (first, second)
    assert {a for _, a in second.values()} == {1}, second


def _rank_2_absent() -> dict:
    return _run_ranks(_store(), 3, first=[0, 1], timeout_s=1.0, absent=(2,))


def _rank_0_absent() -> dict:
    return _run_ranks(_store(), 2, first=[1], timeout_s=1.0, absent=(0,))


# a present rank must arrive within the 1 s the absent one is given: run alone
@pytest.mark.serial
def test_a_rank_0_that_never_comes_is_named():
    assert call_in_fork(_rank_0_absent) == {1: "StartError: rank 0 of this start did not arrive within 1 s"}


@pytest.mark.serial
def test_a_rank_that_never_comes_is_named():
    results = call_in_fork(_rank_2_absent)
    assert results[0] == "StartError: rank(s) [2] of this start did not arrive within 1 s", results
    assert results[1] == "StartError: rank 0 of this start did not admit rank 1 within 1 s", results
