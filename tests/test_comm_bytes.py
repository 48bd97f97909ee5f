"""metrics.jsonl's ``comm_bytes`` is the bytes rank 0 really sent in the step on each group.

One count of traffic: the CommStats of the world, data-parallel and tensor-parallel Comms
(comm.mesh gives each sub-group its own). ``comm_bytes`` reads the dp and tp ones; the per-kind
``comm`` record adds all three, each once.
"""

import json
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks

from distlib.app.config.groups import MetricsConfig
from distlib.app.config.run import RunConfig
from distlib.app.observe.metrics import MetricsLog
from distlib.app.trainer import Trainer
from distlib.comm import collectives
from distlib.comm.layout import Layout
from distlib.comm.mesh import build_mesh

MEMORY = {"params": 0, "grads": 0, "optimizer": 0}


def _log_one_step(comm, tp: int, run_dir: str) -> None:
    world = comm.instrumented(check=False)
    mesh = build_mesh(world, Layout.of(world.size, tp=tp))
    with MetricsLog(
        MetricsConfig(progress_every=0), Path(run_dir), world, 1, 1, groups={"dp": mesh.dp, "tp": mesh.tp}
    ) as log:
        collectives.all_reduce(torch.ones(100), mesh.dp)  # before the step: not in its record
        log.begin_step()
        collectives.all_reduce(torch.ones(10), mesh.dp)
        collectives.all_reduce(torch.ones(30), mesh.tp)
        collectives.broadcast(torch.ones(7), 0, world)
        log.step(
            1, loss=1.0, local_loss=1.0, grad_norm=1.0, param_norm=1.0, lr=0.1, seconds=1.0, memory=MEMORY
        )


def _record(run_dir) -> dict:
    return next(r for r in map(json.loads, open(Path(run_dir) / "metrics.jsonl")) if r["type"] == "step")


def test_comm_bytes_are_each_groups_bytes_sent_and_the_kinds_count_every_group_once(tmp_path):
    # 4 ranks, tp=2: dp and tp groups of 2; the exchange all-reduce sends the buffer to the peer.
    run_ranks(_log_one_step, 4, 2, str(tmp_path / "tp2"))
    rec = _record(tmp_path / "tp2")
    assert rec["comm_bytes"] == {"dp": 4 * 10, "tp": 4 * 30}
    assert rec["comm"]["all_reduce"]["calls"] == 2 and rec["comm"]["all_reduce"]["bytes"]["max"] == 4 * 40
    assert rec["comm"]["broadcast"]["calls"] == 1  # the world's own collectives are counted too
    # tp=1: dp is the world's process group, still counted apart and not twice.
    run_ranks(_log_one_step, 2, 1, str(tmp_path / "tp1"))
    rec = _record(tmp_path / "tp1")
    assert rec["comm_bytes"] == {"dp": 4 * 10, "tp": 0}
    assert rec["comm"]["all_reduce"] == {
        "calls": 1,
        "bytes": {"max": 40.0, "mean": 40.0},
        "seconds": rec["comm"]["all_reduce"]["seconds"],
    }


def _train(comm, tree: dict, run_dir: str) -> int:
    trainer = Trainer(RunConfig.from_dict(tree), comm, Path(run_dir))
    trainer.run()
    return sum(p.layout.padded_numel for p in trainer.optimizer.partitions())


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_stage0_comm_bytes_are_the_all_reduce_the_algorithm_sends_not_the_ring_figure(tmp_path, transport):
    """ZeRO-0 at 4 ranks: per step one all-reduce of the fp32 gradients (B = 4 x padded P) and one
    all-gather of the grad norm's one term (no parameter is tensor-parallel), each with its header
    check. Over gloo, the exchange all-reduce sends B to each of the N-1 peers: (N-1) B, twice the
    ring algorithm's 2 (N-1)/N B that the optimizer used to report, and each header (72 bytes) goes
    to each peer. On the shared-memory board a rank writes its B once, and each header (64 bytes)
    once, for every peer to read."""
    n = 4
    tree = {
        "dist": {"world_size": n, "transport": transport},
        "zero": {"stage": 0},
        "train": {"steps": 3},
        "checkpoint": {"every_steps": 0, "every_minutes": 0},
        "metrics": {"progress_every": 0},
    }
    padded = run_ranks(_train, n, tree, str(tmp_path))[0]
    records = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if r["type"] == "step"]
    b = 4 * padded
    if transport == "gloo":
        expected = (n - 1) * b + (n - 1) * 4 + 2 * (n - 1) * 9 * 8
        assert expected != 2 * (n - 1) * b // n  # the ring figure
    else:
        expected = b + 4 + 2 * 8 * 8
    assert [r["comm_bytes"] for r in records] == [{"dp": expected, "tp": 0}] * 3
