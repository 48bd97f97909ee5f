"""A process that dies with the process that started it (Linux ``prctl(PR_SET_PDEATHSIG)``), so a
launcher killed even by SIGKILL leaves nothing training on: torchrun's and srun's workers, and
``python train.py``'s fork server and the workers it forks (``distlib/launch/fork_server.py``)."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # prctl(2)
PR_SET_NAME = 15


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the process that started it exits (Linux
    prctl PR_SET_PDEATHSIG; elsewhere nothing). If that parent is already gone, leave now."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def name_process(name: str) -> None:
    """This process's name in ps, top and /proc/<pid>/comm (Linux keeps 15 bytes; elsewhere nothing):
    a worker forked from the fork server would otherwise look like every other python process."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        return


def describe_exit(code: int) -> str:
    """A child's exit code in words: the signal that killed it (negative), else the status."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
