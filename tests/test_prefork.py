"""``python train.py``'s fork server is a fork of the launcher (distlib/launch/prefork.py): the
workers multiprocessing starts come from it, a launcher running a thread keeps multiprocessing's own
fresh interpreter, and ``stop()`` reaps whichever served once the workers are gone.

Each case runs as a script in a fork of the test process (tests/forkrun.py): multiprocessing's
fork server state, the threads and the server itself live and die there."""

from __future__ import annotations

import pytest
from forkrun import run_script

SCRIPT = """\
import io, multiprocessing, os, sys, threading
from multiprocessing import forkserver
from distlib.launch import prefork


def parent(queue):
    print("worker", flush=True)
    queue.put(os.getppid())


if __name__ == "__main__":
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False))  # block-buffered, as into a pipe
    print("launcher")  # not written yet when the server is forked
    blocker = threading.Event()
    if sys.argv[1] == "thread":
        threading.Thread(target=blocker.wait, daemon=True).start()
    ours = prefork.start()
    context = multiprocessing.get_context("forkserver")
    queue = context.SimpleQueue()
    worker = context.Process(target=parent, args=(queue,))
    worker.start()
    server = queue.get()
    worker.join()
    assert server == forkserver._forkserver._forkserver_pid, "the worker came from another server"
    line = open(f"/proc/{server}/cmdline", "rb").read()
    same = line == open("/proc/self/cmdline", "rb").read()
    print(f"start={ours} fork_of_this={same} exec_server={b'forkserver' in line} exit={worker.exitcode}")
    blocker.set()
    prefork.stop()
    try:
        os.waitpid(server, os.WNOHANG)
        print("reaped=False")
    except ChildProcessError:  # no such child any more: stop() reaped it
        print("reaped=True")
"""


@pytest.mark.parametrize(
    "case, want",
    [
        ("alone", "start=True fork_of_this=True exec_server=False exit=0"),
        ("thread", "start=False fork_of_this=False exec_server=True exit=0"),
    ],
)
def test_the_workers_server_is_a_fork_unless_a_thread_runs_and_stop_reaps_it(tmp_path, case, want):
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    ran = run_script(script, case, timeout=60)
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = ran.stdout.splitlines()
    # the launcher's unwritten line is written once, not again by the worker forked from its copy
    assert lines.count("launcher") == 1 and lines.count("worker") == 1, ran.stdout
    assert [x for x in lines if x not in ("launcher", "worker")] == [want, "reaped=True"], ran.stdout
