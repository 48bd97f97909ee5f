"""One rank of a run: join the process group, train, report, and leave with the right status.

Every rank is its own process: an interpreter started by torch's elastic agent (``torchrun``) or
by ``srun`` (``run``), or a fork of the fork server of the agent ``python train.py`` runs in its
own process (``start``; ``distlib.launch.local``). The rank dies with the process that started it
(``parent.die_with_parent``), so a launcher killed even by SIGKILL leaves no orphans training on.
Known failures print one line and exit 1: errors every rank agreed on are printed once, by rank 0;
one a rank raised alone (``agreed`` false: a collective whose messages did not fit its call) by
that rank, rank-prefixed; a stalled or lost peer is named by each rank that waited on it. Those
ranks then leave at once (``os._exit``): a dead peer's group cannot be torn down cleanly, and the
launcher is about to restart or stop the job. Under the agent that replaces a lost worker
(``serve``; ``dist.max_restarts``, distlib/launch/agent.py) such a rank stays instead: it leaves
the broken group and trains on in the next generation's (``_stay``). Anything else keeps its
traceback (``@record``).
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.data.tokens import DataError
from distlib.app.observe import summary
from distlib.app.runtime.faults import step_hooks
from distlib.app.runtime.hooks import StepHooks
from distlib.app.trainer import Trainer
from distlib.app.unattended.guard import DesyncError, GuardError
from distlib.app.unattended.stopping import StopSignals
from distlib.checkpoint.sharded import CheckpointError
from distlib.comm import header, shm, watchdog
from distlib.comm.group import Comm
from distlib.comm.header import deliver_sent
from distlib.comm.p2p import CollectiveError, CollectiveMismatchError
from distlib.comm.watchdog import StallError
from distlib.launch import continuation, generations
from distlib.launch.parent import die_with_parent, name_process
from distlib.launch.torchrun import init_process_group, rank_error, use_cuda_device, use_deterministic_kernels

# How long a fork-server worker waits, once its run is over, before it leaves without the agent's
# word (``start``); writing its return value takes microseconds.
WRAPPER_GRACE_S = 2.0
AGREED_ERRORS = (CheckpointError, ConfigError, DataError, GuardError, DesyncError, CollectiveMismatchError)


def leave(code: int) -> None:
    """Exit now, without the interpreter's teardown (stdio flushed first)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start(tree: dict, run_dir: str) -> None:
    """A worker of ``python train.py``'s own launcher (``local.launch``), forked from the fork
    server that imported this module; torch's agent records an unexpected error (``record``)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores it (prefork._serve)
    die_with_parent()
    # what the server imported stays for the whole run: never walked by the collector (train.py's
    # gc.freeze says what that walk cost each rank)
    gc.freeze()
    _run(tree, run_dir)
    # torch's worker wrapper now writes our return value into a pipe and waits for the agent to
    # say it has read it. An agent that is shutting down (it forwarded a SIGTERM, and the run
    # saved and stopped) never says so: the wrapper waited until the agent's SIGKILL, 30 s on. The
    # value stays readable in the pipe after this process exits, so it leaves once the wrapper has
    # had ample time to write it, whether or not the agent said anything.
    timer = threading.Timer(WRAPPER_GRACE_S, leave, args=(0,))
    timer.daemon = True
    timer.start()


def serve(env: dict[str, str], tree: dict, run_dir: str) -> None:
    """A worker of the agent that replaces a lost rank in place (``distlib.launch.agent``), forked
    from the fork server with the rank's ``env``; its exit code is the run's."""
    os.environ.update(env)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores it (prefork._serve)
    die_with_parent()
    name_process(f"distlib-rank{env['RANK']}")  # ps tells the ranks apart (and who is lost)
    gc.freeze()  # as in ``start``
    _run(tree, run_dir)


@record
def run(tree: dict, run_dir: str) -> None:
    """This rank's whole run (torchrun's and srun's workers); exits non-zero when the run failed."""
    _run(tree, run_dir)


def _run(tree: dict, run_dir: str) -> None:
    """The run; exits non-zero when it failed. Under the agent that replaces a lost rank, a
    survivor trains on in the next generation's group (``_stay``)."""
    while True:
        if generations.in_place():  # a replacement, or a survivor in a later generation, resumes
            tree = continuation.resumed_on_restart(tree, generations.current())[0]
        try:
            failures = _train(RunConfig.from_dict(tree), run_dir)
        except (ConfigError, CheckpointError, DataError) as exc:
            rank_error(str(exc))
            sys.exit(1)
        except StallError as exc:  # the rendezvous did not form
            _say_and_leave(exc)
        except PeerLost as exc:
            lost = str(exc)  # only the line: the exception's frames hold the broken generation
        else:
            if failures:
                sys.exit(1)
            return
        _stay(tree, lost)


class PeerLost(Exception):
    """A peer was lost while this rank trained under the agent that replaces it; the message is
    the diagnosed StallError's, said only if no generation follows."""


def _stay(tree: dict, lost: str) -> None:
    """Wait for the agent's next generation (the lost rank's replacement started) and enter it. If
    none follows soon (``generations.WAIT_S``: the peer hung rather than died) or the agent says
    none will, say the original error (``lost``) and leave."""
    header.forget_sent()  # the broken group's: never to be delivered
    # the broken generation's model, optimizer and segments are garbage in cycles (frames of the
    # failed step): freed now, before the next generation builds its own beside them
    gc.collect()
    generation = generations.next_generation(RunConfig.from_dict(tree).dist.timeout_s)
    if generation is None:
        _say_and_leave(StallError(lost))
    generations.enter(generation)


def _say_and_leave(exc: Exception) -> None:
    """A peer stalled or died, or this rank alone failed a collective (a message of another size
    than the call's): say so, rank-prefixed, now, and leave without tearing the group down (a
    dead peer's group cannot be, the others are waiting on this rank, and the first rank to exit
    makes the launcher signal the others: one still tearing down would lose its line)."""
    rank_error(str(exc))
    leave(1)


def _train(cfg: RunConfig, run_dir: str) -> list[str]:
    """Join the process group, train, report; returns the broken invariants (every rank agrees)."""
    torch.set_num_threads(1)
    use_deterministic_kernels()
    device = cfg.device(int(os.environ.get("LOCAL_RANK", "0")))
    if device != "cpu":
        use_cuda_device(device)
    # Fault injection (distlib/app/runtime/faults.py) attaches from outside the loop; none: no-op hooks.
    hooks = step_hooks(cfg.fault, int(os.environ.get("RANK", "0")))
    _join(cfg, hooks, device)
    # From here to this rank's exit a stop signal only asks the run to stop (StopSignals: it saves at
    # a step boundary, or exits after its deadline). torchrun sends every worker SIGTERM once one has
    # died; a survivor still naming the dead rank, between the trainer's own StopSignals and its line,
    # was killed without saying why (1 run in ~8 on a loaded machine, tests/test_job_lifecycle.py).
    with StopSignals(deadline_s=cfg.dist.timeout_s):
        return _train_joined(cfg, run_dir, hooks, device)


def _train_joined(cfg: RunConfig, run_dir: str, hooks: StepHooks, device: str) -> list[str]:
    """Train in the formed process group and report; returns the broken invariants."""
    try:
        # NCCL moves messages between GPUs; gloo between hosts (CUDA tensors are staged through them).
        comm = Comm.world(device=device if cfg.dist.backend == "nccl" else "cpu")
        if comm.size != cfg.dist.world_size:
            raise ConfigError(
                f"dist.world_size={cfg.dist.world_size} but {comm.size} processes were started; "
                f"pass dist.world_size={comm.size} (or start {cfg.dist.world_size} processes)"
            )
        result = Trainer(cfg, comm, Path(run_dir), hooks=hooks, device=device).run()
        t, departures = cfg.train, cfg.departures()
        failures = summary.check_invariants(result, t.loss_tolerance, t.monotone_until_step, departures)
        if comm.rank == 0:
            summary.write_json(result, failures, Path(run_dir) / "report.json")
            summary.print_run(result, failures, cfg.zero.stage, run_dir, comm.size)
            warning = summary.loss_warning(result, t.loss_tolerance, t.monotone_until_step, departures)
            if warning:
                print(warning, file=sys.stderr, flush=True)
        deliver_sent()  # the peers are alive and in the same collectives: every header reaches them
        return failures
    except AGREED_ERRORS as exc:
        return _failed(exc)
    except StallError as exc:
        _lost(exc)
    except CollectiveError as exc:  # a collective outside a step's watch: building the model
        if not generations.in_place():
            raise
        _lost(exc)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _lost(exc: Exception) -> None:
    """A peer stalled or died: under the agent that replaces lost workers this rank stays
    (PeerLost, once its segments say it left: a live peer waiting on it fails now, as on a dead
    one); otherwise it says so and leaves."""
    if not generations.in_place():
        _say_and_leave(exc)
    shm.leave_all()
    raise PeerLost(str(exc)) from exc


def _failed(exc: Exception) -> list[str]:
    """A known error: one every rank raised alike (they agree on it first) is one line, rank 0's;
    one this rank raised alone (``agreed`` false) is said by this rank, which then leaves: no
    other rank can say why, and they are waiting on it."""
    if isinstance(exc, CollectiveMismatchError) and not exc.agreed:
        _say_and_leave(exc)
    deliver_sent()  # every rank raised it alike: the peers are alive, in the same collective
    if dist.get_rank() == 0:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    return [str(exc)]


def _generation_store(cfg: RunConfig):
    """Under the agent that replaces lost workers: this generation's store, once all its ranks
    have arrived (a later generation meanwhile: PeerLost, to move on to it); otherwise None."""
    if not generations.in_place():
        return None
    if not generations.assemble(cfg.dist.world_size, cfg.dist.timeout_s):
        raise PeerLost(f"a rank of generation {generations.current()} was lost while it formed")
    return generations.store(cfg.dist.timeout_s)


def _join(cfg: RunConfig, hooks: StepHooks, device: str = "cpu") -> None:
    """The rendezvous, under dist.timeout_s; a rank that never arrives is named. Any other failure
    (a bad address, a port in use) keeps its own message: it is not a rank that did not arrive."""
    hooks.joining()
    try:
        timeout = datetime.timedelta(seconds=cfg.dist.timeout_s)
        init_process_group(cfg.dist.backend, timeout, device, _generation_store(cfg))
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds; only a timeout is re-worded
        # torch tells a timeout only in the text: DistStoreError "wait timeout after ...", "Timed out
        # initializing ...", a client socket that "has timed out"
        timed_out = re.search(r"\btime(d)?[ -]?out\b", str(exc), re.IGNORECASE)
        if not (isinstance(exc, TimeoutError) or isinstance(exc, RuntimeError) and timed_out):
            raise
        # torch names the store keys it waited for; each ends in the rank that never wrote it
        missing = sorted({int(k) for k in re.findall(r"/(\d+)(?=,|\s|$)", str(exc).partition("keys:")[2])})
        who = f"rank(s) {missing} did not arrive" if missing else "a rank did not arrive"
        raise StallError(
            f"rendezvous: the process group of {cfg.dist.world_size} ranks did not form within "
            f"dist.timeout_s={cfg.dist.timeout_s:g}s: {who} ({exc})"
        ) from exc
    watchdog.announce()  # this rank's host and pid, so a peer can tell it is dead without waiting
