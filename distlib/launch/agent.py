"""``python train.py``'s own agent where a lost worker is replaced and the others stay
(``dist.max_restarts`` > 0).

torch's elastic agent (``local.launch`` otherwise, and torchrun) restarts every worker when one
dies: the ranks that were fine throw away their process, model and optimizer, and four fresh
processes build them again (5.5-6.0 s from a kill to the next step on a 2-core AMD EPYC where
``import torch`` alone takes 3 s; 0.26-0.28 s with this agent: benchmarks/chaos.py, recovery.py).
This agent replaces only the worker that was lost. It hosts the job's TCPStore itself, forks each
worker from the launcher's fork server (torch and the trainer imported already: a replacement costs
a fork, not an interpreter), and watches their exit codes:

- a worker killed by a signal (SIGKILL, the OOM killer, a crash in native code) while every other
  worker still runs is replaced by a new worker of the same rank, up to ``max_restarts`` times in
  the job; the survivors, whose collectives with it failed, leave the broken process group and
  join the next generation's with the replacement (distlib/launch/generations.py), and every rank
  resumes from the newest memory snapshot or checkpoint (``checkpoint.memory_every_steps=1``: at
  most the step in flight is redone);
- any other failure (a worker exiting non-zero: an error it printed; a loss with no restart left,
  or after the others have finished) ends the job: no generation follows, each survivor says why
  it stopped, and this process names the failed ranks in one line and exits 1.

With ``dist.standbys=K`` the replacement is one of K idle workers started ahead of time
(standby.py), not a fork made once the loss is seen.

The store lives in this process, not in a worker, so losing rank 0 is survived like any other.
SIGTERM/SIGINT are forwarded to the workers (they save and stop) as under torch's agent.

Over several hosts (``dist.nodes``, hosts.py) each host runs an agent for its own workers; node
0's serves the store, and the generations, the restarts used and the job's end are counted there
for all of them: a host replaces the workers it lost, and the ranks of every other host stay. A
host lost with its agent (no heartbeat for ``heartbeats.LOST_S``) has its ranks started by the agent
serving the store, in a new generation, as restarts; node 0 lost, the store moves to the next host
that answers, which starts node 0's ranks (succession.py, through ``job_store.JobStore``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

from distlib.launch import generations, heartbeats, hosts, run_lock, worker
from distlib.launch.hosts import Hosts
from distlib.launch.job_store import RESTARTS, JobStore
from distlib.launch.parent import describe_exit
from distlib.launch.standby import Standbys
from distlib.launch.torchrun import ATTEMPT_ENV

POLL_S = 0.01  # how often the agent looks at its workers' exit codes (a wait, not CPU)
SETTLE_S = 2.0  # how long survivors told that no generation follows get to say why and leave
LOCK_WAIT_S = 2.0  # how long node 0's successor waits for the run directory's lock to come free
STOP_GRACE_S = 30.0  # then how long those still running get to stop on SIGTERM (a save included)


class Agent:
    """The workers of one job on this host, replaced in place when lost (see the module's text)."""

    def __init__(
        self,
        tree: dict,
        world_size: int,
        run_dir: str,
        max_restarts: int,
        timeout_s: float,
        standbys: int = 0,
        place: Hosts = hosts.ONE_HOST,
        store: dist.TCPStore | None = None,
    ):
        """``place``: this host's among the job's (one host: all of it); ``store``: node 0's, which
        a host other than node 0 has joined already (node 0 and a one-host job serve their own)."""
        self.tree, self.world_size, self.run_dir = tree, world_size, run_dir
        self.max_restarts, self.timeout_s, self.place = max_restarts, timeout_s, place
        self.job = JobStore(place, timeout_s, store)
        self.context = multiprocessing.get_context("forkserver")
        self.standbys = Standbys(standbys, self.context, (self.job.env, tree, run_dir, timeout_s))
        self.workers: dict[int, multiprocessing.Process] = {}
        self.generation = self.restarts = 0
        self.stop_signal: int | None = None
        self.why_not: str | None = None  # why the failures that ended the job were not replaced
        self.lost_host: str | None = None  # a host lost (or node 0's store gone) that ended the job
        self.fenced: str | None = None  # node 0 took this host for lost: its line
        self.adopted: list[int] = []  # the ranks of lost hosts this host runs
        self.stopped: list[int] = []  # the ranks still running when the job ended (a hung one)

    # -- starting ---------------------------------------------------------------------------
    def _env(self, rank: int) -> dict[str, str]:
        mine = self.place.ranks(self.world_size)
        local = rank - mine.start if rank in mine else len(mine) + self.adopted.index(rank)
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(len(mine)),
            "GROUP_RANK": str(self.place.rank),  # the host's (comm.local.host_key keeps hosts apart)
            **self.job.env,
            generations.ENV: str(self.generation),
            ATTEMPT_ENV: str(self.generation),
        }

    def _spawn(self, rank: int) -> None:
        process = self.context.Process(
            target=worker.serve, args=(self._env(rank), self.tree, self.run_dir), name=f"rank {rank}"
        )
        process.start()
        self.workers[rank] = process

    def _replace(self, lost: dict[int, int]) -> None:
        """A new generation (the survivors, on every host, see it begun), the lost ranks' new workers."""
        self.generation = generations.begin(self.job.store)
        self.restarts = self.job.store.add(RESTARTS, len(lost))
        for rank, code in sorted(lost.items()):
            pid = self.workers[rank].pid
            taker = self._fill(rank)
            print(
                f"rank {rank} was lost ({describe_exit(code)}, pid {pid}): {taker} takes its place and "
                f"the other ranks stay (restart {self.restarts} of dist.max_restarts={self.max_restarts})",
                file=sys.stderr,
                flush=True,
            )

    def _fill(self, rank: int) -> str:
        """``rank``'s new worker: an idle standby if there is one, else a fork; which, in words."""
        standby = self.standbys.take(self._env(rank))
        if standby is None:
            self._spawn(rank)
            return "a new worker"
        self.workers[rank] = standby
        return f"a standby (pid {standby.pid})"

    # -- watching ---------------------------------------------------------------------------
    def run(self) -> tuple[str | None, dict[int, int]]:
        """Run the job to its end: (the stop signal's name if one was forwarded, else None; the
        failed ranks' exit codes, empty when every worker finished)."""
        self.job.open(self.tree, self.run_dir)
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for rank in self.place.ranks(self.world_size):
                self._spawn(rank)
            failed = self._watch()
            if not self.failed(failed) and self.place.count > 1:
                ended = lambda: generations.ended(self.job.store)  # noqa: E731 - (read at each look)
                heartbeats.finished(self.job.store, self.place, self.timeout_s, ended, self.job.serving)
        finally:
            self.standbys.dismiss()
            for s, handler in handlers.items():
                signal.signal(s, handler)
        name = signal.Signals(self.stop_signal).name if self.stop_signal else None
        return name, failed

    def failed(self, ranks: dict[int, int]) -> bool:
        """Whether the job failed: ``ranks`` (failed workers' exit codes), a lost host, a fence."""
        return bool(ranks) or self.lost_host is not None or self.fenced is not None

    def _on_signal(self, signum: int, _frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            self._signal_running(signum)

    def _watch(self) -> dict[int, int]:
        while True:
            codes = {rank: process.exitcode for rank, process in self.workers.items()}
            if all(code == 0 for code in codes.values()):
                return {}
            ended = {rank: code for rank, code in codes.items() if code}
            if not ended:
                if self._hosts_ended():
                    return {}
                if self.stop_signal is None:  # a stopping job needs no standby
                    self.standbys.tend()
                time.sleep(POLL_S)
                continue
            try:
                self.why_not = self._why_not_replaced(ended, codes)
                if self.why_not is None:
                    self._replace(ended)
                    continue
            except (RuntimeError, OSError):  # node 0's store is gone, and with it the job's count
                self.why_not, self.lost_host = "", self.job.gone()
            return self._end(ended)

    def _hosts_ended(self) -> bool:
        """This host's heartbeat, and on node 0 the lost hosts' ranks started here; True when that
        ended the job here (a host lost past the restarts, node 0's store gone, this host fenced)."""
        try:
            lost = self.job.beat()
        except heartbeats.Fenced as exc:  # the job goes on elsewhere: this host's workers only are stopped
            self.fenced = str(exc)
            self._signal_running(signal.SIGKILL)
            return True
        except (RuntimeError, OSError):
            lost = self.job.move()
            if lost is None:
                self.why_not, self.lost_host = "", self.job.gone()
                self._end({})
                return True
            self.standbys.rejoin(self.job.env)
        for host in lost:
            if not self._adopt(host, "its store is gone" if host == 0 else None):
                self._end({})
                return True
        if 0 in lost:  # (after its ranks started: the lock may take a moment to come free)
            self._claim_run_dir()
        return False

    def _claim_run_dir(self) -> None:
        """Serving the store in node 0's place, this launcher also holds the run directory's lock
        that node 0's held (run_lock.py): no second job claims the directory while this one runs
        on. Node 0's processes hold it until the last of them is gone (their kernel's, or the
        shared filesystem's, release), so it is tried for up to LOCK_WAIT_S; a holder then is named
        in one warning."""
        run_dir = Path(self.run_dir)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                run_lock.hold(run_dir, run_dir / self.tree["checkpoint"]["dir"])
                return
            except run_lock.BusyError as exc:
                if time.monotonic() > deadline:
                    print(f"warning: {exc}", file=sys.stderr, flush=True)
                    return
            time.sleep(POLL_S)

    def _adopt(self, host: int, why: str | None = None) -> bool:
        """The host serving the store starts lost host ``host``'s ranks itself, in a new generation;
        False when no restart is left for them. ``why``: how it was lost (None: silent)."""
        ranks = list(Hosts(self.place.count, host).ranks(self.world_size))
        used = self.job.store.add(RESTARTS, 0)
        silent = why or f"no heartbeat from its agent for {heartbeats.LOST_S:g} s"
        if used + len(ranks) > self.max_restarts:
            self.lost_host = f"node {host} ({silent})"
            left = f"dist.max_restarts={self.max_restarts}, {used} used"
            self.why_not = f"; no restart left for its ranks ({left})"
            return False
        self.generation = generations.begin(self.job.store)
        self.restarts = self.job.store.add(RESTARTS, len(ranks))
        self.adopted += ranks
        takers = ", ".join(f"rank {rank}: {self._fill(rank)}" for rank in ranks)
        print(
            f"node {host} was lost ({silent}): its ranks start here ({takers}) and the other ranks "
            f"stay (restart {self.restarts} of dist.max_restarts={self.max_restarts})",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _why_not_replaced(self, ended: dict[int, int], codes: dict[int, int | None]) -> str | None:
        """None when the ended workers were all lost to a signal while every other one still runs,
        with restarts left and no stop asked for (they are replaced); else what the launcher's
        last line adds to their exit codes (empty: an error, or a stop, said by the workers)."""
        if self.stop_signal is not None or any(code > 0 for code in ended.values()):
            return ""
        if any(code is not None for rank, code in codes.items() if rank not in ended):
            return "; the other ranks had ended, so no worker could take its place"
        used = self.job.store.add(RESTARTS, 0)  # (every host's)
        if used + len(ended) > self.max_restarts:
            return f"; no restart left (dist.max_restarts={self.max_restarts}, {used} used)"
        return None

    def _end(self, ended: dict[int, int]) -> dict[int, int]:
        """No generation follows: the survivors leave with their own error. Those still running
        after SETTLE_S (a rank that hangs, one whose peers all left) are asked to stop (SIGTERM:
        as torch's agent does), then killed. The exit codes of the failures that ended the job."""
        try:
            generations.end(self.job.store, f"host {self.place.rank} ended the job")
        except (RuntimeError, OSError):  # node 0's store is gone: the survivors find none follows
            self.lost_host = self.lost_host or self.job.gone()
        self._wait_all(SETTLE_S)
        self.stopped = sorted(rank for rank, p in self.workers.items() if p.exitcode is None)
        self._signal_running(signal.SIGTERM)
        self._wait_all(STOP_GRACE_S)
        self._signal_running(signal.SIGKILL)
        for process in self.workers.values():
            process.join()
        return ended

    def _wait_all(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(p.exitcode is None for p in self.workers.values()):
            time.sleep(POLL_S)

    def _signal_running(self, signum: int) -> None:
        for process in self.workers.values():
            if process.exitcode is None:
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:  # exited, and reaped by the fork server, since we looked
                    pass

    def failure_line(self, failed: dict[int, int]) -> str:
        """The launcher's line for the failures that ended the job (each survivor said its own)."""
        if self.fenced:
            return self.fenced
        lost = [f"rank {rank} ({describe_exit(code)})" for rank, code in sorted(failed.items())]
        ranks = ", ".join(lost + ([self.lost_host] if self.lost_host else []))
        hung = f"; still running {SETTLE_S:g} s after, so stopped: rank(s) {self.stopped}"
        return f"error: training failed: {ranks}{self.why_not or ''}{hung if self.stopped else ''}"
