"""Run a repository script (train.py, ckpt.py, ...) as ``__main__`` in a fork of the test process.

A fresh ``python train.py ...`` pays the interpreter's start and ``import torch`` (3 s here on a
quiet machine, 10 s and more while the suite loads both cores) before it reaches the line that a
config- or checkpoint-error test checks. A fork of the pytest process, which imported torch
already, starts at once. What runs is the same: the script's own ``if __name__ == "__main__":``
code with ``sys.argv`` as given, from the repository root (or ``cwd``), with its exit status and its
stdout/stderr returned as ``subprocess.run`` would (a ``sys.exit("message")`` prints the message
and exits 1, an uncaught exception prints its traceback and exits 1, as the interpreter does).

Use it for runs that end in the one process (errors, `ckpt.py inspect`); the README's commands
and the multi-rank end-to-end tests keep launching real interpreters. Like tests/multiproc.py it
must not fork while a thread is alive in the test process.
"""

from __future__ import annotations

import io
import os
import pickle
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(
    script: Path, args: list[str], env: dict | None, cwd: Path, out_fd: int, err_fd: int, tmp: str
) -> None:
    code = 1
    try:
        # what the script leaves in the temporary directory (multiprocessing's pymp-* of a launcher,
        # which an interpreter's exit would remove and os._exit does not) goes where the parent
        # removes it
        tempfile.tempdir = tmp
        os.setpgid(0, 0)  # its own group: a timeout kills whatever it started
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        sys.stdin = io.TextIOWrapper(io.FileIO(os.open(os.devnull, os.O_RDONLY), "r"))
        os.chdir(cwd)
        os.environ["PYTHONUNBUFFERED"] = "1"
        os.environ.update(env or {})
        # read at an interpreter's start, which a fork has had: applied here as it would be there
        sys.dont_write_bytecode = sys.dont_write_bytecode or bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
        sys.argv = [str(script), *args]
        sys.path[0] = str(script.parent)
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter would print for any of them
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def run_script(
    script: str | Path,
    *args: str,
    env: dict | None = None,
    cwd: str | Path = ROOT,
    timeout: float = 120,
    merged: bool = False,
) -> subprocess.CompletedProcess:
    """``python <script> <args>`` (the script's path relative to the repository root, or absolute)
    in a fork of this process, from ``cwd`` (the repository root unless given). ``merged``: stdout
    and stderr into one stream, in the order written, as a terminal shows them (returned as stdout;
    stderr empty)."""
    script = (ROOT / script).resolve()
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryDirectory(prefix="fork") as tmp,
    ):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(script, list(args), env, Path(cwd), out.fileno(), (out if merged else err).fileno(), tmp)
        try:
            os.setpgid(pid, pid)  # also here, so a kill right after the fork finds the group
        except OSError:
            pass  # the child did it first (or already exited)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired([str(script), *args], timeout)
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            [str(script), *args],
            os.waitstatus_to_exitcode(status),
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
        )


def call_in_fork(fn, *args, timeout: float = 60):
    """``fn(*args)`` in a forked child; its return value (pickled back), or an AssertionError with
    the child's traceback. For tests that need threads or a store server of their own: those
    then live and die in the child, and the test process stays safe to fork afterwards."""
    with tempfile.TemporaryFile() as result:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                payload = (True, fn(*args))
            except BaseException:  # noqa: BLE001 - reported to the parent
                payload, code = (False, traceback.format_exc()), 1
            try:
                pickle.dump(payload, result)
                result.flush()
            finally:
                os._exit(code)
        deadline = time.monotonic() + timeout
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not return within {timeout:g} s")
            time.sleep(0.02)
        result.seek(0)
        try:
            ok, value = pickle.load(result)
        except EOFError:
            raise AssertionError(f"{getattr(fn, '__name__', fn)}: the child died without a result") from None
        if not ok:
            raise AssertionError(f"in the forked child:\n{value}")
        return value
