"""``python train.py``'s own launcher: torch's elastic agent, with the workers forked from a process
that has imported them already.

The agent runs in this process, as torchrun's does in its own (``elastic_launch``: the same
rendezvous, store and monitoring), and starts each worker as ``worker.start(tree, run_dir)``, the
run's configuration as this process checked it, with torch's environment (RANK, WORLD_SIZE, ...).
The workers are not forks of this process once the agent runs (its store server thread could
leave a child a lock held forever), but of multiprocessing's fork server, which ``prefork`` forks
from this process just before, while it still runs no thread: it has torch and the trainer imported
already, single-threaded, and forks each worker from there. So no process of the job imports torch
after the launcher: measured on 2 cores (AMD EPYC, ``benchmarks/startup.py``), the capstone takes
4.1 s and 4.9 CPU-s, against 6.9 s and 7.9 CPU-s with multiprocessing's own server, a fresh
interpreter importing them again (what a launcher already running a thread gets).

With ``dist.max_restarts`` > 0, or over several hosts (``dist.nodes``), the agent is this
project's own (``agent.py``: a lost worker is replaced and the others stay), forking its workers
from the same server; a host other than node 0 starts here too (``follow``), with node 0's
configuration (hosts.py).

On SIGTERM/SIGINT the agent forwards the signal; the workers finish their step, save and stop,
and this process exits 0 if the run's log says they did (1 otherwise). A failed worker's one-line
error is its own; this process adds one line naming the ranks and exit codes (and the traceback
of an unexpected exception, which is a bug).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from distlib.app.observe.metrics import last_event
from distlib.launch import hosts, prefork, succession
from distlib.launch.hosts import Hosts

# What multiprocessing's own fork server (where prefork cannot fork one) imports before it forks a
# worker: first what makes it die with this process (fork_server.py says why), then the worker's
# module and, through it, torch.
PRELOAD = ["distlib.launch.fork_server", "distlib.launch.worker"]


# multiprocessing's fork server listens on <temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX, an AF_UNIX
# path of at most 107 bytes: the temp dir (TMPDIR) may have 107 - 32 = 75
SOCKET_PATH_BYTES = 107
SOCKET_TAIL_BYTES = len("/pymp-12345678/listener-12345678")


def temp_dir_problem() -> str | None:
    """Why the workers' fork server could not listen in this temporary directory (too long a
    path: Python would fail with "AF_UNIX path too long" after the run started), or None."""
    tmp = tempfile.gettempdir()
    room, size = SOCKET_PATH_BYTES - SOCKET_TAIL_BYTES, len(os.fsencode(tmp))
    if size <= room:
        return None
    return (
        f"the temporary directory {tmp} (TMPDIR) is {size} bytes long; the workers' fork server "
        f"listens on a socket inside it, whose path may have {SOCKET_PATH_BYTES} bytes: use a "
        f"directory of at most {room} bytes (TMPDIR=/tmp)"
    )


def launch(
    tree: dict,
    world_size: int,
    run_dir: str,
    metrics_file: str,
    preload: tuple[str, ...] = (),
    max_restarts: int = 0,
    timeout_s: float = 60.0,
    standbys: int = 0,
    place: Hosts = hosts.ONE_HOST,
) -> None:
    """Run ``world_size`` workers of the checked configuration ``tree`` in ``run_dir`` to the end;
    exits this process on failure. The modules ``preload`` names, which every worker would import
    itself, are imported here once, before the workers are forked. With ``max_restarts`` > 0 a
    lost worker is replaced and the others stay (``agent.Agent``; ``timeout_s``: its store's;
    ``standbys``: idle workers kept ready to replace one); so over several hosts too (``place``:
    node 0's, which serves the others)."""
    if max_restarts > 0 or place.count > 1:
        _start_fork_server(preload)
        _launch_in_place(tree, world_size, run_dir, metrics_file, (max_restarts, timeout_s, standbys), place)
        return
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from distlib.launch import worker

    # the agent's per-attempt directory of the workers' error files: ours to remove once read
    # (torch's own default is a fresh /tmp/torchelastic_* per launch, never removed)
    logs = tempfile.mkdtemp(prefix="torchelastic_")
    config = LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=logs),
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="forkserver",
    )
    _start_fork_server(preload)
    # The workers print their own one-line errors; the agent's tracebacks would bury them.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    started = time.time()
    try:
        elastic_launch(config, worker.start)(tree, run_dir)
    except SignalException as exc:
        _stopped(signal.Signals(exc.sigval).name, Path(run_dir), metrics_file, started)
    except ChildFailedError as exc:
        _failed(exc)
    finally:
        prefork.stop()  # the workers are gone: so is their server
        shutil.rmtree(logs, ignore_errors=True)


def _start_fork_server(preload: tuple[str, ...]) -> None:
    for name in preload:
        importlib.import_module(name)
    multiprocessing.set_forkserver_preload([*PRELOAD, *preload])  # for the server multiprocessing would start
    prefork.start()  # the server as a fork of this process, before the agent's first thread


def follow(argv: list[str], rank: int, store: str | None, timeout_s: float) -> None:
    """A host other than node 0 of a several-host job (``hosts.follower``): join node 0's store,
    take its configuration and run directory, and run this host's workers to the end; exits this
    process on failure, one line for a host that cannot join."""
    from distlib.app.config.operation import store_address
    from distlib.app.config.run import ConfigError, RunConfig
    from distlib.app.model import recompute

    try:
        address = store_address(store)
    except ConfigError as exc:
        hosts.HostError(f"config error: {exc}").leave()
    try:
        joined = hosts.connect(address, timeout_s)
        tree, run_dir = hosts.job(joined, argv, rank, timeout_s)
        succession.offer(joined, rank, address)
        joined.wait([succession.SUCCESSORS])  # node 0 lists the offers once every host joined
    except hosts.HostError as exc:
        exc.leave()
    except (RuntimeError, OSError) as exc:
        hosts.HostError(f"error: joining node 0's store at {store}: {hosts.first_line(exc)}").leave()
    d = RunConfig.from_dict(tree).dist
    place = Hosts(d.nodes, rank, address, tuple(argv))
    ranks = list(place.ranks(d.world_size))
    print(
        f"node {rank} joined the job at {store}: ranks {ranks} run here; run directory {run_dir}", flush=True
    )
    # (the store's client runs no thread: the fork server may still be a fork of this process)
    _start_fork_server(recompute.imports(tree["model"]["activation_checkpointing"]))
    restarts = (d.max_restarts, d.timeout_s, d.standbys)
    _launch_in_place(tree, d.world_size, run_dir, tree["metrics"]["file"], restarts, place, joined)


def _launch_in_place(
    tree, world_size, run_dir, metrics_file, restarts: tuple, place: Hosts, store=None
) -> None:
    """``launch`` under the agent that replaces a lost worker while the others stay (``restarts``:
    its max_restarts, timeout_s and standbys), the fork server started."""
    from distlib.launch.agent import Agent

    started = time.time()
    try:
        agent = Agent(tree, world_size, run_dir, *restarts, place=place, store=store)
        stopped, failed = agent.run()
    except hosts.HostError as exc:
        exc.leave()
    finally:
        prefork.stop()
    if stopped:
        _stopped(stopped, Path(run_dir), metrics_file, started, place)
    if agent.failed(failed):
        print(agent.failure_line(failed), file=sys.stderr)
        sys.exit(1)


def _stopped(
    name: str, run_dir: Path, metrics_file: str, since: float, place: Hosts = hosts.ONE_HOST
) -> None:
    """The launcher's line for a stop it forwarded: how to continue (on every host of a job over
    several, the same command: a host other than node 0 needs the store's address)."""
    end = last_event(run_dir / metrics_file, "run_end", since=since)
    if end and end["status"] == f"stopped by {name}":
        how = f"checkpoint.resume=latest hydra.run.dir={run_dir}"
        if place.count > 1:
            store = f"{place.address[0]}:{place.address[1]}"
            how += f" dist.store={store} on every host, each with its dist.node_rank"
        print(
            f"{name}: the workers saved a checkpoint at step {end['step']} and stopped; continue with {how}",
            file=sys.stderr,
        )
        sys.exit(0)
    print(
        f"error: {name} received and the workers did not report a clean stop (see {run_dir})", file=sys.stderr
    )
    sys.exit(1)


def _failed(exc) -> None:
    failed = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(exc.failures.items()))
    print(f"error: training failed: {failed}", file=sys.stderr)
    for r, failure in sorted(exc.failures.items()):
        # an unexpected exception is recorded in torchelastic's error file (@record); it is a bug,
        # so its traceback is printed too, as torchrun's workers do
        if isinstance(failure.message, dict) and "message" in failure.message:
            stack = failure.message.get("extraInfo", {}).get("py_callstack", "")
            print(f"rank {r}: {stack or failure.message['message']}".rstrip(), file=sys.stderr)
    sys.exit(1)
