"""Only a rendezvous that timed out is reported as a group that "did not form";
any other failure to join keeps its own type and message."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from distlib.app.config.run import RunConfig
from distlib.app.runtime.hooks import StepHooks
from distlib.comm.watchdog import StallError
from distlib.launch import worker

CFG = RunConfig.from_dict({"dist": {"world_size": 2, "timeout_s": 5}})


def _failing_join(monkeypatch, exc: Exception) -> None:
    def init_process_group(backend, timeout, device="cpu", store=None):
        raise exc

    monkeypatch.setattr(worker, "init_process_group", init_process_group)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError(
            "Error initializing torch.distributed using env:// rendezvous: environment variable "
            "MASTER_ADDR expected, but not set"
        ),
        dist.DistNetworkError(
            "The server socket has failed to listen on any local network address. port: 29500, "
            "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
        ),
        RuntimeError("Unsupported backend: nccl1"),
    ],
    ids=["no_master_addr", "port_in_use", "bad_backend"],
)
def test_other_errors_pass_through_with_their_own_message(monkeypatch, exc):
    _failing_join(monkeypatch, exc)
    with pytest.raises(type(exc)) as err:
        worker._join(CFG, StepHooks())
    assert err.value is exc and not isinstance(err.value, StallError)


@pytest.mark.parametrize(
    "exc, who",
    [
        (
            dist.DistStoreError("wait timeout after 5000ms, keys: /default_pg/0//cpu//1"),
            "rank(s) [1] did not arrive",
        ),
        (
            dist.DistStoreError(
                "Timed out initializing process group in store based barrier on rank 0, for key: "
                "store_based_barrier_key:1 (world_size=2, num_workers_joined=1, timeout=0:00:05 error=)"
            ),
            "a rank did not arrive",
        ),
        (
            dist.DistNetworkError(
                "The client socket has timed out after 5000ms while trying to connect to (localhost, 29500)."
            ),
            "a rank did not arrive",
        ),
        (TimeoutError(), "a rank did not arrive"),
    ],
    ids=["store_wait", "store_barrier", "client_connect", "timeout_error"],
)
def test_a_timeout_names_the_ranks_that_did_not_arrive(monkeypatch, exc, who):
    _failing_join(monkeypatch, exc)
    with pytest.raises(StallError) as err:
        worker._join(CFG, StepHooks())
    assert str(err.value).startswith(
        f"rendezvous: the process group of 2 ranks did not form within dist.timeout_s=5s: {who} ("
    )
    assert err.value.__cause__ is exc
