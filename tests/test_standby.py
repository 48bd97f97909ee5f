"""The agent's standbys (distlib/launch/standby.py) as bookkeeping, on stand-in processes and
pipes: which one takes a lost rank's place, which are replaced, and when no more are started.
Real standbys taking real ranks' places: tests/test_survivors_stay.py and tests/test_chaos.py."""

from __future__ import annotations

from distlib.launch.standby import Standbys


class _Process:
    pids = iter(range(100, 10_000))

    def __init__(self, target, args, name):
        self.pid, self.exitcode, self.args = next(self.pids), None, args

    def start(self) -> None:
        pass


class _Pipe:
    def __init__(self):
        self.sent, self.closed, self.broken = [], False, False

    def send(self, value) -> None:
        if self.broken:
            raise BrokenPipeError("the standby is gone")
        self.sent.append(value)

    def close(self) -> None:
        self.closed = True


class _Context:
    Process = _Process

    @staticmethod
    def Pipe(duplex: bool):  # noqa: N802 - multiprocessing's name
        assert not duplex
        return _Pipe(), _Pipe()


def test_a_lost_rank_takes_the_oldest_idle_standby_and_an_empty_pool_says_none():
    standbys = Standbys(2, _Context, ("address",))
    standbys.tend()
    first, second = (s.process for s in standbys.idle)
    orders = standbys.idle[0].orders
    assert standbys.take({"RANK": "3"}) is first
    assert orders.sent == [{"RANK": "3"}] and orders.closed  # the pipe has done its one job
    assert standbys.take({"RANK": "1"}) is second
    assert standbys.take({"RANK": "2"}) is None  # none idle: the agent forks one
    standbys.tend()
    assert len(standbys.idle) == 2  # both started again


def test_a_standby_whose_pipe_broke_is_passed_over():
    standbys = Standbys(2, _Context, ())
    standbys.tend()
    standbys.idle[0].orders.broken = True
    second = standbys.idle[1].process
    assert standbys.take({"RANK": "0"}) is second and standbys.idle == []


def test_one_killed_while_idle_is_replaced_and_one_that_failed_by_itself_ends_the_pool(capsys):
    standbys = Standbys(1, _Context, ())
    standbys.tend()
    killed = standbys.idle[0].process
    killed.exitcode = -9
    standbys.tend()
    assert [s.process for s in standbys.idle] != [killed] and len(standbys.idle) == 1
    failed = standbys.idle[0].process
    failed.exitcode = 1  # its own error: a new one would fail the same way
    standbys.tend()
    assert standbys.idle == [] and standbys.take({"RANK": "0"}) is None
    assert capsys.readouterr().err.splitlines() == [
        f"a standby (pid {killed.pid}) was lost while idle (killed by SIGKILL): another is started; "
        "no restart is used",
        f"a standby (pid {failed.pid}) was lost while idle (exit 1): no more are started, lost workers "
        "are forked; no restart is used",
    ]


def test_none_are_kept_when_none_are_asked_for():
    standbys = Standbys(0, _Context, ())
    standbys.tend()
    assert standbys.idle == [] and standbys.take({"RANK": "0"}) is None


def test_a_standby_that_cannot_join_the_store_says_so_in_one_line_and_fails(tmp_path):
    """A standby whose job's store is unreachable (nothing listens at its address) leaves with
    status 1 and one line naming the store, not a Python traceback (the agent then ends the pool;
    torch's own C++ log of the failed connection comes before it, as for a rank's rendezvous)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import multiprocessing\n"
        "from distlib.launch.standby import stand_by\n"
        "orders, _ = multiprocessing.Pipe(duplex=False)\n"
        f"address = {{'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': '{port}'}}\n"
        f"stand_by(orders, address, {{}}, {str(tmp_path)!r}, 1.0)\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    ours = [line for line in done.stderr.splitlines() if line.startswith("error [standby pid ")]
    assert done.returncode == 1, done.stderr
    assert len(ours) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"could not join the job's store at 127.0.0.1:{port}: " in ours[0]
