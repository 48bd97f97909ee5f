"""The forked-rank harness itself: a gloo connect flake before the test's function ran is retried
(all ranks afresh, said on stderr); a real failure is not."""

import multiproc
import pytest
import torch.distributed as dist
from multiproc import run_ranks


def _rank(comm):
    return comm.rank


def test_a_connect_flake_before_the_function_runs_is_retried(tmp_path, monkeypatch, capfd):
    real = dist.init_process_group
    marker = tmp_path / "failed-once"

    def flaky(*args, **kwargs):
        if kwargs.get("rank") == 1 and not marker.exists():
            marker.touch()
            raise RuntimeError("Gloo connectFullMesh failed with [...] Connection closed by peer")
        return real(*args, **kwargs)

    monkeypatch.setattr(multiproc.dist, "init_process_group", flaky)  # the forked ranks inherit it
    assert run_ranks(_rank, 2) == [0, 1]
    assert marker.exists() and "starting the 2 ranks again (attempt 2 of 3)" in capfd.readouterr().err


def _fails(comm):
    raise ValueError(f"a real failure on rank {comm.rank}")


def test_a_real_failure_is_reported_not_retried(capfd):
    with pytest.raises(AssertionError, match="a real failure on rank 0"):
        run_ranks(_fails, 2)
    assert "starting the" not in capfd.readouterr().err


def test_a_flake_that_persists_is_reported_after_the_retries(monkeypatch):
    def always(*args, **kwargs):
        raise RuntimeError("Gloo connectFullMesh failed with [...] Connection closed by peer")

    monkeypatch.setattr(multiproc.dist, "init_process_group", always)
    with pytest.raises(AssertionError, match="gloo rendezvous failed before the test ran"):
        run_ranks(_rank, 2)
