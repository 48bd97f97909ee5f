"""``python train.py``'s fork server as a fork of the launcher, not a fresh interpreter.

multiprocessing's fork server is started by fork + exec: a new interpreter that imports the
preload modules (torch and the trainer) before it forks the workers, 2.5 CPU-s and ~1.5 s of wall
time per run on 2 cores. The launcher has imported all of them already, and until torch's agent
starts its store server it runs no thread, so a fork of it taken then is the same server without
the import (a fork of a process with threads could inherit a lock held forever; that is why the
server is not forked later, nor the workers from the agent's process). ``start()`` forks it and
hands it to multiprocessing as its fork server, so the agent (``start_method="forkserver"``)
forks every worker from it, exactly as from the one multiprocessing would start. The server dies
with the launcher (``die_with_parent``), as the exec'd one does through ``fork_server.py``.

Where the launcher already runs a thread, or multiprocessing's fork server lacks the attributes
this sets (CPython 3.11's ``ForkServer``), ``start()`` does nothing and multiprocessing starts its
own at the first worker, as before.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from multiprocessing import connection, forkserver, resource_tracker

from distlib.launch.parent import die_with_parent

_STATE = ("_lock", "_forkserver_pid", "_forkserver_address", "_forkserver_alive_fd")


def single_threaded() -> bool:
    """Whether this process runs one thread (Linux: its task list; elsewhere assume not)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _server():
    """multiprocessing's ForkServer, where it has the attributes used here; else None."""
    server = getattr(forkserver, "_forkserver", None)
    return server if all(hasattr(server, name) for name in _STATE) else None


def start() -> bool:
    """Fork this process into multiprocessing's fork server, if it is safe here and none runs yet;
    True when one of ours serves this process."""
    server = _server()
    if server is None or not single_threaded():
        return False
    with server._lock:
        if server._forkserver_pid is not None:
            return False
        # the tracker every worker is handed (a small interpreter of its own, as before)
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            # every client holds the write end; the server leaves when the read end sees them gone
            alive_r, alive_w = os.pipe()
            # what this process printed and has not written yet would be written again by every
            # worker forked from the copy (stdout to a pipe or file is block-buffered)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _serve(listener.fileno(), alive_r, alive_w)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def stop(timeout_s: float = 2.0) -> None:
    """Once the workers are gone: tell the fork server (ours or multiprocessing's) that its clients
    are, and reap it within ``timeout_s`` (its CPU time then counts in this process's children's, and
    nothing outlives the run). One still there by then dies with this process."""
    server = _server()
    if server is None or server._forkserver_pid is None:
        return
    with server._lock:
        pid, alive_w = server._forkserver_pid, server._forkserver_alive_fd
        server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
        os.close(alive_w)
        deadline = time.monotonic() + timeout_s
        try:
            while os.waitpid(pid, os.WNOHANG)[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        except ChildProcessError:  # not this process's child (a server its parent started): not ours to reap
            pass


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The fork server's whole life (never returns): what the exec'd one runs, without the imports."""
    code = 1
    try:
        os.close(alive_w)
        die_with_parent()
        # A SIGTERM sent to every process of the job (pkill -f train.py, systemd's or a container's
        # stop) would end the server at once, and with it every worker (their parent-death signal)
        # before they saved: the launcher asks them to stop instead. The server goes with the
        # launcher; its workers restore the default (worker.start, worker.serve).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        forkserver.main(listener_fd, alive_r, [])
        code = 0
    except SystemExit as exc:  # how it leaves once every client has gone
        code = exc.code if isinstance(exc.code, int) else 0
    finally:
        os._exit(code)
