"""Warm standbys (``dist.standbys``): idle workers of ``python train.py``'s own agent, each ready to
take a lost rank's place.

Without them the agent (agent.py) forks a lost rank's replacement from the fork server once the
loss is seen, on the recovery's path. A standby is that fork made ahead of time: torch and the
trainer imported (the fork server's), connected to the job's store, named ``distlib-standby`` in
ps, and asleep on a pipe from the agent, holding no model. When a worker is lost the agent sends a
standby the rank's environment down its pipe; the standby becomes that rank's worker
(``worker.serve``) and builds only that rank's state, as a forked replacement would, and the agent
starts another standby at once (waiting a second instead left the kills of benchmarks/chaos.py,
a quarter of a second apart, without one; starting it at once did not slow their recoveries). A
standby that dies while idle is replaced too, and costs no restart; the agent closing the pipe
(the job's end) is a standby's cue to leave.
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from distlib.launch import generations, succession, worker
from distlib.launch.parent import describe_exit, die_with_parent, name_process

NAME = "distlib-standby"


def stand_by(orders: Connection, env: dict[str, str], tree: dict, run_dir: str, timeout_s: float) -> None:
    """A standby's life (forked from the fork server): wait for a rank's environment on
    ``orders`` and serve as that rank; leave when the agent closes the pipe. ``env``: the store's
    address."""
    os.environ.update(env)
    # SIGTERM stays ignored, as in the fork server (prefork._serve), until it serves (worker.serve):
    # an idle standby ends with the agent (its pipe closed), not with a stop the workers save for
    die_with_parent()
    name_process(NAME)
    gc.freeze()  # as worker.serve: what the server imported is never walked by the collector
    store = f"the job's store at {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
    try:
        # (the store is up whenever a standby starts: one that does not answer at once is gone, and
        # torch's client would wait dist.timeout_s for it)
        if not succession.answers(env["MASTER_ADDR"], int(env["MASTER_PORT"]), 1.0):
            raise ConnectionRefusedError("no answer")
        generations.base_store(timeout_s)  # joined now: the connection is the rank's when it serves
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds; each is this one line
        sys.stderr.write(f"error [standby pid {os.getpid()}]: could not join {store}: {_first_line(exc)}\n")
        worker.leave(1)
    try:
        rank_env = orders.recv()
    except EOFError:  # dismissed: the job is over
        worker.leave(0)
    orders.close()
    worker.serve(rank_env, tree, run_dir)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class Standby:
    process: object  # multiprocessing's Process
    orders: Connection  # the agent's end of the pipe


class Standbys:
    """The agent's ``count`` standbys: started, handed out, replaced, dismissed."""

    def __init__(self, count: int, context, args: tuple):
        self.count, self.context, self.args = count, context, args
        self.idle: list[Standby] = []

    def _start(self) -> None:
        orders_in, orders_out = self.context.Pipe(duplex=False)
        process = self.context.Process(target=stand_by, args=(orders_in, *self.args), name="standby")
        process.start()
        orders_in.close()  # the standby's end: the agent keeps only its own
        self.idle.append(Standby(process, orders_out))

    def tend(self) -> None:
        """Drop the standbys that died idle (each said in a line) and start the missing ones. One
        that failed by itself (an exit status, not a signal) would fail again: no more are started."""
        for standby in [s for s in self.idle if s.process.exitcode is not None]:
            self.idle.remove(standby)
            standby.orders.close()
            code = standby.process.exitcode
            if code > 0:
                self.count = 0
            then = "another is started" if self.count else "no more are started, lost workers are forked"
            print(
                f"a standby (pid {standby.process.pid}) was lost while idle ({describe_exit(code)}): "
                f"{then}; no restart is used",
                file=sys.stderr,
                flush=True,
            )
        while len(self.idle) < self.count:
            self._start()

    def rejoin(self, env: dict[str, str]) -> None:
        """The job's store moved (succession.py): the standbys started from now on join it at
        ``env`` (those idle already reconnect when they serve: the rank's environment says where)."""
        self.args = (env, *self.args[1:])

    def take(self, env: dict[str, str]):
        """A standby's process, serving as the rank ``env`` describes from now on; None when none
        is idle (or the one tried had died)."""
        while self.idle:
            standby = self.idle.pop(0)
            try:
                standby.orders.send(env)
            except OSError:  # it died since it was last seen: the next one
                continue
            finally:
                standby.orders.close()
            return standby.process
        return None

    def dismiss(self) -> None:
        """The job's end: every idle standby is told to leave (its pipe closed), then waited for."""
        for standby in self.idle:
            standby.orders.close()
        for standby in self.idle:
            standby.process.join(timeout=5.0)
            if standby.process.exitcode is None:
                standby.process.kill()
                standby.process.join()
        self.idle.clear()
