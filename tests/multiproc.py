"""Run a function on N real gloo ranks inside one test.

Ranks are forked from the test process (which has already imported torch), so a
4-rank test starts in well under a second instead of re-importing torch per
rank. The rendezvous store is hosted by the parent on a port the OS picks, so
tests running in parallel never collide on MASTER_PORT.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distlib.comm.group import Comm
from distlib.comm.header import deliver_sent

DEFAULT_TIMEOUT_S = 120.0
# gloo's full-mesh connect on loopback has failed now and then on this 2-core machine under load
# ("Connection closed by peer", seen once in ~40 full runs): an infrastructure flake before the
# test's function ran on any rank. run_ranks then starts all ranks afresh, at most RETRIES times,
# and says so on stderr; any other failure is reported as it is.
RENDEZVOUS_FLAKE = "gloo rendezvous failed before the test ran: "
RETRIES = 2


def _child(rank: int, world_size: int, ports, fn, args, queue, timeout_s: float) -> None:
    try:
        torch.set_num_threads(1)
        port = ports.get()  # the parent starts the store only after forking us (see run_ranks)
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        try:
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except RuntimeError as exc:
            if "connectFullMesh" not in str(exc):
                raise
            queue.put((rank, False, RENDEZVOUS_FLAKE + traceback.format_exc()))  # before fn ran anywhere
            return
        try:
            result = fn(Comm.world(), *args)
            deliver_sent()  # its last collective's header sends, before this rank leaves
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """Call ``fn(comm, *args)`` on ``world_size`` forked ranks; return results by rank.

    Raises AssertionError carrying the child's traceback if any rank fails, and
    TimeoutError naming the ranks that did not finish within ``timeout_s``.
    """
    for attempt in range(RETRIES + 1):
        results, failures = _run_once(fn, world_size, args, timeout_s)
        flaky = [f for f in failures.values() if f.startswith(RENDEZVOUS_FLAKE)]
        if not flaky or attempt == RETRIES:
            break
        print(
            f"multiproc: {flaky[0].splitlines()[-1][:200]} -- starting the {world_size} ranks again "
            f"(attempt {attempt + 2} of {RETRIES + 1})",
            file=sys.stderr,
            flush=True,
        )
    if failures:
        first = min(failures)
        # the others' last lines too: the rank that failed first (a lost connection, say) need not
        # be the lowest, whose own error may only be the wait for it
        others = "".join(f"\nrank {r}: {_last_line(failures[r])}" for r in sorted(failures)[1:])
        raise AssertionError(
            f"rank {first} failed:\n{failures[first]}" + (f"\nalso failed:{others}" if others else "")
        )
    return [results[r] for r in range(world_size)]


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float
) -> tuple[dict[int, Any], dict[int, str]]:
    ctx = mp.get_context("fork")
    queue, ports = ctx.Queue(), ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, ports, fn, args, queue, timeout_s), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    # Fork first, start the store second: a thread alive in the parent at fork time (the store's
    # event loop, resolving a peer's name) can leave a libc lock held forever in a child (seen:
    # ranks stuck in getnameinfo's resolver lock, the others timing out in the rendezvous).
    try:
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except BaseException:
        for p in procs:
            p.kill()
        raise
    for _ in procs:
        ports.put(store.port)
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(results) + len(failures) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - results.keys() - failures.keys())
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: check for ranks that died without reporting
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and r not in results and r not in failures
                ]
                if dead and queue.empty():
                    for r in dead:
                        failures[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting"
                continue
            (results if ok else failures)[rank] = payload
            if not ok and payload.startswith(RENDEZVOUS_FLAKE):
                break  # the others may wait in their rendezvous or first collective: stop them
    finally:
        for p in procs:
            p.join(timeout=0 if any(f.startswith(RENDEZVOUS_FLAKE) for f in failures.values()) else 5)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    return results, failures


def _last_line(text: str) -> str:
    lines = [line for line in str(text).splitlines() if line.strip()]
    return lines[-1][:400] if lines else "(no output)"
