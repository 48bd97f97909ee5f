"""The unattended-run machinery (guard, rollback, replica check, collective checks and counts)
under the parallel layouts: ZeRO-2/3, where gradients and parameters are partitions, and tensor
parallelism, where ranks of one data-parallel group hold different shards of the model."""

import hashlib
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from trainrun import compose_tree, small_tree

from distlib.app.config.operation import GuardConfig
from distlib.app.config.run import RunConfig
from distlib.app.runtime.faults import step_hooks
from distlib.app.trainer import Trainer
from distlib.app.unattended import guard
from distlib.app.unattended.guard import DesyncError, GuardError
from distlib.comm import collectives
from distlib.comm.layout import Layout
from distlib.comm.mesh import build_mesh
from distlib.comm.p2p import CollectiveMismatchError
from distlib.parallel.flat_layout import ParamSlot


def config(**groups) -> dict:
    return small_tree(8, 3, **groups)


def _train(comm, tree, run_dir):
    try:
        cfg = RunConfig.from_dict(tree)
        trainer = Trainer(cfg, comm, Path(run_dir), hooks=step_hooks(cfg.fault, comm.rank))
        result = trainer.run()
    except (GuardError, DesyncError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    # The bytes this rank holds (a partition at stage 3), and the whole model it computes with.
    held = trainer.optimizer.params_snapshot()
    return {
        "losses": {s.step: s.loss.hex() for s in result.steps},
        "params": hashlib.sha256(held.view(torch.uint8).numpy().tobytes()).hexdigest(),
        "rollbacks": result.rollbacks,
        "resume_ok": result.resume_check.ok if result.resume_check else None,
    }


def train(tree, run_dir) -> list[dict]:
    return run_ranks(_train, tree["dist"]["world_size"], tree, str(run_dir))


# --------------------------------------------------------------------------- rollback


@pytest.mark.parametrize(
    "layout, fault, trip_step, to_step",
    [
        # lr spike at step 2 shows at step 3: back to the step-0 state kept in memory
        ({"zero": {"stage": 3}}, {"lr_spike_step": 2, "lr_spike_factor": 1000.0}, 3, 0),
        # NaN in rank 1's gradient partition (already reduced during backward): back to checkpoint 3
        ({"zero": {"stage": 2}}, {"nan_grad_rank": 1, "nan_grad_step": 5}, 5, 3),
        # lr spike after checkpoint 3 was trusted, on 2 tensor-parallel ranks (one data-parallel group)
        ({"zero": {"stage": 3}, "dist": {"tp": 2}}, {"lr_spike_step": 5, "lr_spike_factor": 1000.0}, 6, 3),
        # NaN in the first pipeline stage's gradient (the loss lives on the last): 2 stages, one rank each
        ({"dist": {"pp": 2}}, {"nan_grad_rank": 0, "nan_grad_step": 5}, 5, 3),
    ],
)
def test_rollback_recovers_bitwise_at_zero_2_3_and_with_tensor_parallelism(
    tmp_path, layout, fault, trip_step, to_step
):
    clean = train(config(**layout), tmp_path / "clean")
    faulty = train(config(**layout, fault=fault), tmp_path / "faulty")
    assert faulty[0]["rollbacks"] == faulty[1]["rollbacks"]
    (rollback,) = faulty[0]["rollbacks"]
    assert (rollback["step"], rollback["to_step"]) == (trip_step, to_step), rollback
    for rank in range(2):
        assert faulty[rank]["losses"] == clean[rank]["losses"]  # every step, bit for bit
        assert faulty[rank]["params"] == clean[rank]["params"]
        assert faulty[rank]["resume_ok"] is True


# --------------------------------------------------------------------------- the verdict


def _verdict(comm, local_losses, norms, loss_ranks):
    v = guard.check_step(
        local_losses[comm.rank],
        norms[comm.rank],
        [1.0],
        GuardConfig(spike_factor=10.0),
        comm,
        loss_ranks=loss_ranks,
    )
    return v.loss.hex(), v.trip


def test_the_loss_is_one_data_parallel_groups_mean_and_any_ranks_bad_norm_trips_every_rank():
    # World 4 as 2 data-parallel x 2 tensor-parallel: global ranks 0 and 2 form a data-parallel group.
    losses, norms = [1.0, 1.0, 4.0, 4.0], [0.5, 0.5, 0.5, 0.5]
    per_rank = run_ranks(_verdict, 4, losses, norms, (0, 2))
    assert len(set(per_rank)) == 1
    assert float.fromhex(per_rank[0][0]) == (1.0 + 4.0) / 2 and per_rank[0][1] is None
    per_rank = run_ranks(_verdict, 4, losses, [0.5, 0.5, 0.5, float("nan")], (0, 2))
    assert len(set(per_rank)) == 1 and "non-finite gradient norm" in per_rank[0][1]


# --------------------------------------------------------------------------- replica check


def _replicas_tp(comm, perturb):
    # Two parameters: "split" differs between tensor ranks by design, "shared" is replicated.
    slots = [ParamSlot("split", (4,), 0), ParamSlot("shared", (4,), 4)]
    tp_rank = comm.rank % 2
    flat = torch.cat([torch.full((4,), float(tp_rank)), torch.ones(4)])
    for rank, offset in perturb:
        if comm.rank == rank:
            flat[offset] += 1.0
    try:
        guard.check_replicas([(flat, slots, False)], 3, comm, Layout.of(4, tp=2), split={"split"})
        return None
    except DesyncError as exc:
        return str(exc)


def test_replica_check_under_tensor_parallelism_compares_only_what_must_be_identical():
    # Split shards differ across tensor ranks: not a desync.
    assert run_ranks(_replicas_tp, 4, []) == [None] * 4
    # Rank 3's shard differs from rank 1's (same tensor rank); rank 2's replicated copy from everyone's.
    messages = run_ranks(_replicas_tp, 4, [(3, 0), (2, 4)])
    assert len(set(messages)) == 1
    msg = messages[0]
    assert "rank 2 differs in 1 of 2 parameter(s): shared" in msg
    assert "rank 3 differs in 1 of 2 parameter(s): split" in msg
    assert "rank 0 " not in msg and "rank 1 " not in msg


@pytest.mark.parametrize("stage", [1, 3])
def test_a_perturbed_replicated_parameter_is_named_under_tensor_parallelism(tmp_path, stage):
    # With dist.tp=2 on 2 ranks each rank is its own data-parallel group; ln_f.bias is replicated
    # across the tensor ranks (at stage 3 the check gathers the parameters first).
    tree = config(
        zero={"stage": stage},
        dist={"tp": 2},
        guard={"check_sync_every": 2},
        fault={"perturb_rank": 1, "perturb_step": 2, "perturb_param": "ln_f.bias"},
    )
    results = train(tree, tmp_path)
    assert results[0] == results[1]
    assert results[0]["error"] == (
        "DesyncError: desync at step 2: replicated parameters are not byte-identical "
        "across 2 ranks: rank 1 differs in 1 of 30 parameter(s): ln_f.bias"
    )


def test_a_perturbed_tensor_parallel_shard_is_named_within_its_data_parallel_group(tmp_path):
    # 2 data-parallel x 2 tensor-parallel: rank 3 holds the same fc shard as rank 1.
    tree = config(
        dist={"world_size": 4, "tp": 2},
        train={"steps": 2},
        guard={"check_sync_every": 2},
        fault={"perturb_rank": 3, "perturb_step": 2, "perturb_param": "blocks.0.mlp.fc.weight"},
    )
    results = run_ranks(_train, 4, tree, str(tmp_path))
    assert len({r["error"] for r in results}) == 1
    assert results[0]["error"] == (
        "DesyncError: desync at step 2: replicated parameters are not byte-identical "
        "across 4 ranks: rank 3 differs in 1 of 30 parameter(s): blocks.0.mlp.fc.weight"
    )


def _replicas_ep(comm, perturb):
    # World 4 at ep 2: ranks 0 and 1 (and 2 and 3) hold other experts, 0 and 2 (1 and 3) the same.
    held = "e0" if comm.rank in (0, 2) else "e1"
    dense, experts = [ParamSlot("dense", (4,), 0)], [ParamSlot(held, (4,), 0)]
    flat_dense, flat_experts = torch.ones(4), torch.full((4,), float(held == "e1"))
    for rank, name in perturb:
        if comm.rank == rank:
            (flat_dense if name == "dense" else flat_experts)[0] += 1.0
    try:
        parts = [(flat_dense, dense, False), (flat_experts, experts, True)]
        guard.check_replicas(parts, 3, comm, Layout.of(4, ep=2))
        return None
    except DesyncError as exc:
        return str(exc)


def test_replica_check_under_expert_parallelism_compares_an_expert_where_it_is_held():
    # Other experts on the ranks of an expert group: not a desync.
    assert run_ranks(_replicas_ep, 4, []) == [None] * 4
    messages = run_ranks(_replicas_ep, 4, [(3, "e1"), (2, "dense")])
    assert len(set(messages)) == 1
    assert messages[0] == (
        "desync at step 3: replicated parameters are not byte-identical across 4 ranks: "
        "rank 2 differs in 1 of 2 parameter(s): dense; rank 3 differs in 1 of 2 parameter(s): e1"
    )


MIXTRAL_EP = ["model=mixtral_tiny", "dist.world_size=4", "dist.ep=2", "train.steps=2"]
MIXTRAL_EP += ["checkpoint.every_steps=0", "metrics.progress_every=0", "guard.check_sync_every=2"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "zero,rank,param",
    [
        ("stage1", 2, "blocks.1.mlp.experts.2.w2.weight"),  # rank 2 holds experts 0-3, as rank 0 does
        ("stage2", 3, "blocks.0.attn.q_proj.weight"),  # dense: the same on all 4 ranks
    ],
)
def test_a_perturbed_parameter_is_named_under_expert_parallelism(tmp_path, zero, rank, param):
    tree = compose_tree([*MIXTRAL_EP, f"zero={zero}", f"fault.perturb_rank={rank}"])
    tree["fault"].update(perturb_step=2, perturb_param=param)
    results = run_ranks(_train, 4, tree, str(tmp_path))
    assert len({r["error"] for r in results}) == 1
    error = results[0]["error"]
    assert error.startswith(
        "DesyncError: desync at step 2: replicated parameters are not byte-identical "
        f"across 4 ranks: rank {rank} differs in 1 of "
    ), error
    assert error.endswith(f" parameter(s): {param}") and error.count("differs") == 1, error


@pytest.mark.slow
@pytest.mark.parametrize("zero,compared", [("stage1", None), ("stage3", 4)])
def test_a_perturbed_expert_bias_is_named(tmp_path, zero, compared):
    """model.balance=bias moves every MoE block's expert biases alike on every rank: one ulp on rank
    3's is a desync. At ZeRO 3 with tp 1 no parameter is held twice: the 4 biases alone are compared."""
    tree = compose_tree([*MIXTRAL_EP, "model.balance=bias", f"zero={zero}", "fault.perturb_rank=3"])
    tree["fault"].update(perturb_step=2, perturb_param="blocks.1.mlp.score_bias")
    results = run_ranks(_train, 4, tree, str(tmp_path))
    assert len({r["error"] for r in results}) == 1
    error = results[0]["error"]
    assert error.startswith(
        "DesyncError: desync at step 2: replicated parameters are not byte-identical "
        "across 4 ranks: rank 3 differs in 1 of "
    ), error
    assert error.endswith(" parameter(s): blocks.1.mlp.score_bias") and error.count("differs") == 1, error
    if compared is not None:  # the biases alone
        assert f"differs in 1 of {compared} parameter(s)" in error, error


@pytest.mark.slow
def test_an_expert_a_rank_does_not_hold_is_not_perturbed_and_the_replicas_agree(tmp_path, capfd):
    tree = compose_tree([*MIXTRAL_EP, "fault.perturb_rank=1"])  # rank 1 holds experts 4-7
    tree["fault"].update(perturb_step=2, perturb_param="blocks.0.mlp.experts.0.w1.weight")
    results = run_ranks(_train, 4, tree, str(tmp_path))
    assert all("error" not in r and len(r["losses"]) == 2 for r in results), results
    assert (
        "rank 1: holds no blocks.0.mlp.experts.0.w1.weight (another rank's expert)" in capfd.readouterr().err
    )


# --------------------------------------------------------------------------- collectives


def _uneven(comm, mismatch):
    comm = comm.instrumented(check=True)
    bounds = [(0, 2), (2, 2), (2, 10)]
    if mismatch and comm.rank == 1:
        bounds = [(0, 3), (3, 3), (3, 10)]
    try:
        out = collectives.reduce_scatter(torch.ones(10), comm, bounds=bounds)
    except CollectiveMismatchError as exc:
        return str(exc)
    full = torch.zeros(10)
    collectives.all_gather(full, out, comm, bounds=bounds)
    s = comm.stats
    return out.tolist(), full.tolist(), s.bytes_sent["reduce_scatter"], s.bytes_sent["all_gather"]


def test_uneven_bounds_are_counted_and_checked():
    per_rank = run_ranks(_uneven, 3, False)
    sizes, header = [2, 0, 8], 9 * 8 * 2  # 9 int64 header words to each of the 2 peers
    for rank, (out, full, rs_bytes, ag_bytes) in enumerate(per_rank):
        assert out == [3.0] * sizes[rank] and full == [3.0] * 10
        assert rs_bytes == header + 4 * (10 - sizes[rank])  # every chunk but its own
        assert ag_bytes == header + 4 * 2 * sizes[rank]  # its chunk to both peers
    messages = run_ranks(_uneven, 3, True)
    assert all("mismatched collective" in m and "bounds#" in m for m in messages), messages


def _mesh_riders(comm, tp):
    world = comm.instrumented(check=True)
    mesh = build_mesh(world, Layout.of(world.size, tp=tp))
    collectives.all_reduce(torch.ones(3), mesh.tp)
    collectives.all_reduce(torch.ones(3), mesh.dp)
    collectives.all_reduce(torch.ones(5), mesh.dp)
    distinct = len({id(c.stats) for c in (world, mesh.dp, mesh.tp)})
    return (
        distinct,
        mesh.dp.check and mesh.tp.check,
        [c.stats.calls["all_reduce"] for c in (world, mesh.dp, mesh.tp)],
    )


def test_mesh_subgroups_count_apart_and_carry_the_worlds_header_check():
    """The dp and tp groups count their own traffic (the world's stats keep the world-level
    collectives), also at tp=1 where dp talks over the world's process group."""
    assert run_ranks(_mesh_riders, 4, 2) == [(3, True, [0, 2, 1])] * 4
    assert run_ranks(_mesh_riders, 2, 1) == [(3, True, [0, 2, 0])] * 2
