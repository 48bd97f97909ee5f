"""The planner's step time (distlib/app/plan/timing.py): what a layout's dry step counts -- the
arithmetic against the model's formula, the messages against what each dimension sends -- the
ZeRO stages' collectives, the pricing, and the rank correlation --verify reports. How well the
prediction ranks real runs is measured by benchmarks/plan_time.py, not here."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from distlib.app.config.run import RunConfig
from distlib.app.plan import dry_inputs, meta_memo
from distlib.app.plan.activations import stage_counts
from distlib.app.plan.report import predicted_time
from distlib.app.plan.states import stage_groups
from distlib.app.plan.timing import BOARD_MEET_S, Counted, Machine, OpCounter, grouped, step_time
from distlib.comm import collectives, tally
from distlib.comm.group import Comm
from distlib.comm.p2p import P2P
from distlib.launch import plan_verify
from distlib.launch.hydra_config import compose_tree
from distlib.parallel.zero.predict import sync_parts

MACHINE = Machine(flops=1e10, op_s=1e-6, byte_s=1e-10, update_s=1e-9, cores=2)


def config(*words: str) -> RunConfig:
    return RunConfig.from_dict(compose_tree(list(words)))


def forward_flops(cfg: RunConfig) -> int:
    """minigpt's forward by hand: 2 per matmul weight and token (attention's four projections, the
    MLP's two, the head), and per sequence and block the scores and their weighted sum (2 x S x S x
    d each, every position: the counter counts the full product)."""
    m = cfg.model
    d, s, tokens = m.dim, m.seq_len, cfg.global_batch * m.seq_len
    weights = m.n_layers * (4 * d * d + 2 * d * m.mlp_ratio * d) + d * m.vocab_size
    return 2 * weights * tokens + cfg.global_batch * m.n_layers * 2 * (2 * s * s * d)


@pytest.mark.parametrize("accum", [1, 2])
def test_one_ranks_step_counts_the_forward_and_twice_it_backward_over_every_micro_batch(accum):
    cfg = config("dist.world_size=1", f"train.grad_accum={accum}")
    (counted,) = stage_counts(cfg)
    assert counted.flops == 3 * forward_flops(cfg) and counted.calls == ()


def test_pipeline_stages_split_the_arithmetic_and_send_one_message_per_micro_batch_each_way():
    whole = config("dist.world_size=1")
    cfg = config("dist.world_size=2", "dist.pp=2", "train.grad_accum=2")
    first, last = stage_counts(cfg)
    assert first.flops + last.flops == stage_counts(whole)[0].flops and min(first.flops, last.flops) > 0
    micro = cfg.global_batch // 2
    activation = micro * cfg.model.seq_len * cfg.model.dim * 4  # fp32
    assert first.calls == (("send", activation, 2, 2),)  # forward activations, one per micro-batch
    assert last.calls == (("send", activation, 2, 2),)  # their gradients, back


def test_tensor_parallel_blocks_all_reduce_twice_forward_and_twice_backward():
    cfg = config("dist.world_size=2", "dist.tp=2")
    (counted,) = stage_counts(cfg)
    m = cfg.model
    activations = cfg.global_batch * m.seq_len * m.dim * 4
    assert counted.calls == (("all_reduce", activations, 2, 4 * m.n_layers),)
    assert counted.flops < stage_counts(config("dist.world_size=1"))[0].flops


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_reduce_every_gradient_once_and_gather_the_parameters(stage):
    cfg = config("dist.world_size=2", f"zero.stage={stage}", "zero.bucket_numel=2000", "train.dtype=bf16")
    ((module, flat, segments),) = stage_groups(cfg.model, cfg.dist, 0)
    per_micro_batch, per_step = sync_parts(stage, module, flat, torch.bfloat16, 2000, False, segments)
    assert (per_micro_batch == []) == (stage < 2)  # stages 2/3 reduce after every micro-batch
    calls = per_micro_batch + per_step
    kinds = {kind for kind, _ in calls}
    reduced = sum(n for kind, n in calls if kind in ("all_reduce", "reduce_scatter"))
    gathered = sum(n for kind, n in calls if kind == "all_gather")
    if stage == 0:
        assert calls == [("all_reduce", 4 * flat.padded_numel)]
    elif stage == 1:
        assert calls == [("reduce_scatter", 4 * flat.padded_numel), ("all_gather", 2 * flat.padded_numel)]
    elif stage == 2:  # by buckets of about 2,000 elements, then the parameters once
        assert kinds == {"reduce_scatter", "all_gather"} and len(calls) > 3
        assert reduced == 4 * flat.numel and gathered == 2 * flat.padded_numel
    else:  # each unit gathered in forward and in backward, its gradients reduced
        assert reduced == 4 * flat.numel and gathered == 2 * 2 * flat.numel


def test_a_planning_group_is_tallied_and_a_real_one_or_a_lone_rank_is_not():
    dry, lone = Comm(ranks=(0, 1), rank=0, dry=True), Comm(ranks=(0,), rank=0, dry=True)
    t = torch.zeros(6)
    collectives.all_reduce(t, dry)  # outside tallied(): nothing is kept
    with tally.tallied() as notes:
        collectives.all_reduce(t, dry)
        collectives.reduce_scatter(t, dry)
        collectives.all_to_all(torch.zeros(4, 3), dry, [1, 3])
        collectives.all_reduce(t, lone)
        collectives.all_reduce(t, Comm(ranks=(0,), rank=0))  # a real group of one
        P2P("pipeline", dry).send(torch.zeros(5, dtype=torch.float64), 1)
        P2P("pipeline", dry).send(torch.zeros(0), 1)  # an empty message is not sent
    assert notes == [("all_reduce", 24, 2), ("reduce_scatter", 24, 2), ("all_to_all", 48, 2), ("send", 40, 2)]


def test_operators_are_counted_with_the_bytes_they_write_and_views_write_none():
    a = torch.ones(4, 8, device="meta")
    with OpCounter() as counter:
        b = a + 1  # 128 bytes written
        b.add_(a)  # in place: 128 more
        b.view(32)  # views: none
        b.t()
        torch.var_mean(a, dim=1)  # two results of 4 floats
    assert (counter.ops, counter.written) == (5, 128 + 128 + 16 + 16)


def test_a_counter_with_memory_counts_as_one_without_and_answers_what_it_has_seen():
    """``OpCounter(memory)``: a small MLP's forward and backward on the meta device counted the same
    as without memory, the first time and the second; the second time every operator that makes a
    new tensor is answered from memory (nothing added to it, no kernel run), in new storage; with
    ``results`` the CPU's layer_norm statistics (bf16) are what it counts and remembers."""
    torch.manual_seed(0)
    with torch.device("meta"):
        mlp = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    mlp = mlp.to(torch.bfloat16)
    x = torch.empty(4, 16, device="meta", dtype=torch.bfloat16)

    def step(counter: OpCounter) -> tuple:
        mlp.zero_grad(set_to_none=True)  # each step's gradients new, not added to the last's
        with counter:
            out = mlp(x)
            out.float().sum().backward()
        return (counter.ops, counter.flops, counter.written), out

    with dry_inputs._CpuKernels():  # the reference: the CPU's kernels as a mode of their own
        want, first = step(OpCounter())
    memory: dict = {}
    got, _ = step(OpCounter(memory, dry_inputs.cpu_results))
    remembered = len(memory)
    ran = []
    with _calls_to_kernels(ran):
        again, second = step(OpCounter(memory, dry_inputs.cpu_results))
    assert got == again == want and want[1] > 0
    assert remembered > 10 and len(memory) == remembered
    # views and in-place results still run; of the others only the empty tensors answers are made of
    made_of = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}
    assert {op for op, answerable in ran if answerable} <= made_of
    assert any(answerable for _, answerable in ran)
    assert any(not answerable for _, answerable in ran)
    assert second.untyped_storage()._cdata != first.untyped_storage()._cdata and second.shape == first.shape


class _calls_to_kernels(TorchDispatchMode):
    """Records each operator that reaches the kernels (below every counter), and whether one with
    memory could have answered it."""

    def __init__(self, ran: list) -> None:
        super().__init__()
        self.ran = ran

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ran.append((func, meta_memo.key_of(func, args, kwargs) is not None))
        return func(*args, **kwargs)


def test_one_rank_a_core_takes_its_own_time_and_more_ranks_share_the_cores():
    counted = Counted(int(4e8), 1000, 10**6, (("all_reduce", 1024, 2, 1),))
    own = 4e8 / 1e10 + 1000 * 1e-6 + 10**6 * 1e-10 + 100 * 1e-9
    alone = step_time([(counted, 100)], 2, 2, 1, 1, 64, MACHINE)  # 2 ranks, 2 cores
    assert alone.compute_s == pytest.approx(own) and alone.bubble_s == 0
    assert alone.comm_s == pytest.approx(BOARD_MEET_S + 2 * 1024 * 0.1e-9)
    shared = step_time([(counted, 100)], 4, 4, 1, 1, 64, MACHINE)  # 4 ranks on 2 cores: twice as long
    assert shared.compute_s == pytest.approx(2 * own)
    assert shared.tokens_per_s == pytest.approx(64 / shared.total_s)


def test_a_pipeline_is_its_critical_path_or_all_its_work_over_the_cores_whichever_is_longer():
    slow, quick = Counted(int(4e8), 0, 0, ()), Counted(int(1e8), 0, 0, ())
    fb = 4e8 / 1e10
    # 2 stages of 2 ranks on 2 cores, 4 micro-batches x 2 chunks: the cores are the limit
    busy = step_time([(slow, 0), (quick, 0)], 4, 2, 4, 2, 64, MACHINE)
    assert busy.compute_s == pytest.approx((4e8 + 1e8) / 1e10 * 2 / 2) and busy.bubble_s == 0
    # one micro-batch, one rank a stage: the slowest stage twice (forward, then the other's backward)
    bubbly = step_time([(slow, 0), (quick, 0)], 2, 1, 1, 1, 64, MACHINE)
    assert bubbly.compute_s == pytest.approx(fb) and bubbly.total_s == pytest.approx(2 * fb)


def test_experts_are_timed_their_routing_counted_first_or_not_and_dense_layouts_are():
    experts = ["model=mixtral_tiny", "dist.world_size=2"]
    for counted in (["dist.pp=2", "train.grad_accum=2"], ["dist.ep=2", "train.grad_accum=2"]):
        timed = predicted_time(config(*experts, *counted), MACHINE)
        assert timed.compute_s > 0 and timed.comm_s > 0
    assert predicted_time(config(*experts, "dist.ep=2"), MACHINE).compute_s > 0
    timed = predicted_time(config("dist.world_size=4", "zero.stage=3"), MACHINE)
    plain = predicted_time(config("dist.world_size=4", "zero.stage=1"), MACHINE)
    assert timed.comm_s > plain.comm_s > 0 and timed.compute_s > 0


def test_the_biases_update_is_timed_as_the_all_reduce_it_makes():
    """``model.balance=bias``: the step's counts all-reduced after the update (outside the dry step)
    are what ``BiasBalance.update`` sends, over the batch ranks and the stages; none on one rank."""
    from distlib.app.model.bias_balance import BiasBalance
    from distlib.app.model.placement import layout_model, place_model_
    from distlib.app.plan import report
    from distlib.comm.mesh import shape_mesh

    for words in (
        ["dist.world_size=4", "dist.ep=2"],
        ["dist.world_size=4", "dist.tp=2"],
        ["dist.world_size=4", "dist.pp=2"],
        ["dist.world_size=2", "dist.pp=2"],
        ["dist.world_size=1"],
    ):
        cfg = config("model=deepseek_v3_tiny", "model.n_layers=4", *words)
        mesh = shape_mesh(cfg.layout, 0)
        model = layout_model(cfg, mesh, 0)
        place_model_(model, cfg, mesh)
        with tally.tallied() as calls:
            BiasBalance(model, mesh, 0.001).update()
        assert report._bias_update(cfg) == grouped(calls), words
    assert report._bias_update(config("model=mixtral_tiny", "dist.world_size=2")) == ()


def test_the_probe_measures_this_machine():
    m = Machine.probe()
    assert m.flops > 1e8 and 0 < m.op_s < 1e-3 and 0 < m.byte_s < 1e-8 and 0 < m.update_s < 1e-6
    assert m.cores >= 1


@pytest.mark.parametrize(
    "xs, ys, rho",
    [
        ([1, 2, 3, 4], [10, 20, 30, 40], 1.0),
        ([1, 2, 3, 4], [4, 3, 2, 1], -1.0),
        ([1, 2, 2, 3], [1, 2, 3, 4], 0.9486832980505138),  # a tie shares its mean rank
        ([1, 2], [1, 2], None),  # too few
        ([1, 1, 1], [1, 2, 3], None),  # no spread
        ([], [], None),
    ],
)
def test_the_rank_correlation(xs, ys, rho):
    got = plan_verify.spearman(xs, ys)
    assert got == rho if rho is None else got == pytest.approx(rho)
