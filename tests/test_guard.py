"""The guard's verdict, the replica check, the split optimizer step, collective header checks,
per-kind accounting and the stall diagnosis, on real gloo ranks."""

import datetime
import json
import math
import socket
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks

from distlib.app.config.groups import OptimizerConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.operation import GuardConfig
from distlib.app.model.minigpt import build_model
from distlib.app.unattended import guard
from distlib.comm import collectives, watchdog
from distlib.comm.group import Comm
from distlib.comm.layout import Layout
from distlib.comm.p2p import CollectiveMismatchError
from distlib.comm.watchdog import StallError, watch
from distlib.parallel.zero import make_optimizer

# --------------------------------------------------------------------------- the verdict


def _verdicts(comm, cases):
    out = []
    for local_losses, grad_norm, history, cfg in cases:
        v = guard.check_step(local_losses[comm.rank], grad_norm, history, GuardConfig(**cfg), comm)
        out.append((v.loss.hex(), v.trip))
    return out


def test_verdict_is_identical_on_every_rank_and_trips_for_the_right_reasons():
    nan = float("nan")
    cases = [
        ([1.0, 2.0, 3.0], 0.5, [], {}),  # no history: nothing to compare with
        ([1.0, 2.0, 3.0], 0.5, [1.5], {}),  # 2.0 <= 2 x 1.5
        ([1.0, 2.0, 9.0], 0.5, [1.5], {}),  # 4.0 > 2 x 1.5: spike
        ([1.0, nan, 3.0], 0.5, [9.0], {}),  # one rank's loss is NaN
        ([1.0, 2.0, 3.0], float("inf"), [9.0], {}),  # gradient norm overflowed
        ([1.0, 2.0, 9.0], 0.5, [1.5], {"enabled": False}),  # disabled: never trips
        ([1.0, 2.0, 9.0], 0.5, [1.5], {"spike_factor": 3.0}),  # 4.0 <= 3 x 1.5
        ([1.0, 2.0, 9.0], 0.5, [1.0, 3.0], {"spike_window": 2}),  # reference = mean(1, 3) = 2: 4 <= 4
        ([1.0, 2.0, 9.0], 0.5, [1.0, 1.5], {"spike_window": 2}),  # reference 1.25: spike
    ]
    per_rank = run_ranks(_verdicts, 3, cases)
    assert per_rank[0] == per_rank[1] == per_rank[2]
    trips = [trip for _, trip in per_rank[0]]
    assert [t is not None for t in trips] == [False, False, True, True, True, False, False, False, True]
    assert "loss spike" in trips[2] and "2 x 1.5" in trips[2]
    assert "non-finite loss" in trips[3] and "1 rank" in trips[3]
    assert "non-finite gradient norm" in trips[4]
    assert "mean of the last 2" in trips[8]
    # The global loss is the same float64 SUM / N as agree.mean gives the log.
    assert float.fromhex(per_rank[0][0][0]) == (1.0 + 2.0 + 3.0) / 3
    assert math.isnan(float.fromhex(per_rank[0][3][0]))


# --------------------------------------------------------------------------- the replica check


def _replicas(comm, perturb_rank, names, world):
    model = build_model(ModelConfig(), seed=0)
    opt = make_optimizer(model, comm, 1, OptimizerConfig().adamw)
    (group,) = opt.groups.values()  # a dense model: one parameter group
    slots = {s.name: s for s in group.layout.slots}
    if comm.rank == perturb_rank:
        for name in names:
            x = group.flat_params[slots[name].offset : slots[name].offset + 1]
            x.copy_(torch.nextafter(x, torch.full_like(x, math.inf)))
    try:
        guard.check_replicas(opt.replica_parts(), 7, comm, Layout.of(comm.size))
        return None
    except guard.DesyncError as exc:
        return str(exc)


@pytest.mark.parametrize("world", [2, 3])
def test_replica_check_names_the_divergent_rank_and_parameter(world):
    assert run_ranks(_replicas, world, None, [], world) == [None] * world
    messages = run_ranks(_replicas, world, world - 1, ["blocks.1.attn.qkv.weight", "ln_f.bias"], world)
    assert len(set(messages)) == 1, "every rank must reach the same verdict"
    msg = messages[0]
    assert (
        f"rank {world - 1} differs in 2 of" in msg
        and "blocks.1.attn.qkv.weight" in msg
        and "ln_f.bias" in msg
    )
    assert "desync at step 7" in msg
    assert all(f"rank {r} " not in msg for r in range(world - 1)), msg


# --------------------------------------------------------------------------- the split step

LR, CLIP, STEPS = 0.02, 0.5, 3


def _batch(step, rank):
    return torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(10 * step + rank))


def _split_step(comm, stage, split):
    model = build_model(ModelConfig(), seed=0)
    opt = make_optimizer(model, comm, stage, OptimizerConfig().adamw, grad_clip=CLIP)
    norms = []
    for i in range(STEPS):
        tokens = _batch(i, comm.rank)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        if split:
            norms.append(opt.sync_grads())
            opt.apply_update(lr=LR)
        else:
            norms.append(opt.step(lr=LR))
        opt.zero_grad()
    return norms, opt.full_params().clone().numpy()


@pytest.fixture(scope="module")
def torch_reference():
    """One process: the mean of the 2 ranks' gradients, torch's clip_grad_norm_, torch.optim.AdamW."""
    world = 2
    model = build_model(ModelConfig(), seed=0)
    kwargs = {**OptimizerConfig().adamw.torch_kwargs(), "lr": LR}
    opt = torch.optim.AdamW(model.parameters(), **kwargs, foreach=False)
    norms = []
    for i in range(STEPS):
        for rank in range(world):
            tokens = _batch(i, rank)
            (model(tokens[:, :-1], tokens[:, 1:]) / world).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return norms, torch.cat([p.detach().flatten() for p in model.parameters()])


def _key_biases():
    """The flat positions of the key biases: attention's softmax ignores them, so their true
    gradient is 0 and what backward gives is rounding noise, which Adam normalises into a step
    of up to ~lr in any direction."""
    dim, mask = ModelConfig().dim, []
    for name, p in build_model(ModelConfig(), seed=0).named_parameters():
        part = torch.zeros(p.numel(), dtype=torch.bool)
        part[dim : 2 * dim] = name.endswith("attn.qkv.bias")
        mask.append(part)
    return torch.cat(mask)


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("split", [True, False], ids=["sync_grads+apply_update", "step"])
def test_a_step_averages_clips_and_updates_as_torch_does_on_one_process(stage, split, torch_reference):
    ref_norms, ref_params = torch_reference
    assert min(ref_norms) > CLIP, "every step must be clipped"
    norms, params = run_ranks(_split_step, 2, stage, split)[0]
    assert norms == pytest.approx(ref_norms, rel=1e-6), "the global grad norm before clipping"
    diff = (torch.from_numpy(params) - ref_params).abs()
    noise = _key_biases()
    # Reduction order differs (the norm by ~1 ulp); a wrong average, a missing or wrong clip or
    # AdamW step would move most elements by ~lr per step.
    assert diff[~noise].max() < 1e-4 * LR * STEPS, f"max |diff| {diff[~noise].max():.3g}"
    assert diff[noise].max() <= 2 * LR * STEPS


def test_apply_update_without_synced_grads_is_refused():
    opt = make_optimizer(build_model(ModelConfig(), seed=0), Comm.world(), 1, OptimizerConfig().adamw)
    with pytest.raises(RuntimeError, match="needs sync_grads"):
        opt.apply_update()
    opt.sync_grads()
    opt.zero_grad()  # a discarded (guard-tripped) step cannot be applied later
    with pytest.raises(RuntimeError, match="needs sync_grads"):
        opt.apply_update()


# --------------------------------------------------------------------------- header check


def _mismatch(comm, case):
    comm = comm.instrumented(check=True)
    r = comm.rank
    try:
        if case == "size":
            n = 8 if r == 0 else 12
            collectives.all_gather(torch.zeros(n), torch.ones(n // 2), comm)
        elif case == "dtype":
            collectives.all_reduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64), comm)
        elif case == "kind":
            if r == 0:
                collectives.broadcast(torch.ones(4), 0, comm)
            else:
                collectives.all_reduce(torch.ones(4), comm)
        elif case == "op":
            collectives.all_reduce(torch.ones(4), comm, op="sum" if r == 0 else "max")
        elif case == "matched":
            t = torch.ones(5)
            collectives.all_reduce(t, comm)
            return t.tolist()
        return "no error"
    except CollectiveMismatchError as exc:
        return str(exc)


@pytest.mark.parametrize(
    "case, expect",
    [
        ("size", ["all_gather(numel=8", "all_gather(numel=12"]),
        ("dtype", ["dtype=float32", "dtype=float64"]),
        ("kind", ["rank 0 (global 0) called broadcast(", "rank 1 (global 1) called all_reduce("]),
        (
            "op",
            [
                "all_reduce(numel=4, dtype=float32, op=sum, algo=exchange) as collective #0",
                "all_reduce(numel=4, dtype=float32, op=max, algo=exchange) as collective #0",
            ],
        ),
    ],
)
def test_mismatched_collectives_raise_a_descriptive_error_on_every_rank(case, expect):
    messages = run_ranks(_mismatch, 2, case, timeout_s=30)
    for msg in messages:
        assert "mismatched collective" in msg, msg
        for part in expect:
            assert part in msg, msg


def test_matching_collectives_pass_the_header_check():
    assert run_ranks(_mismatch, 3, "matched") == [[3.0] * 5] * 3


# --------------------------------------------------------------------------- accounting


def _accounting(comm, numel):
    comm = comm.instrumented(check=False)
    t = torch.ones(numel)
    collectives.reduce_scatter(t, comm, algo="ring")
    collectives.reduce_scatter(t, comm, algo="direct")
    collectives.all_reduce(t, comm, algo="ring")  # counted once, as an all_reduce
    collectives.all_reduce(t, comm, algo="exchange")
    s = comm.stats
    return {k: (s.calls[k], s.bytes_sent[k], s.seconds[k] > 0) for k in s.calls}


def test_comm_stats_count_bytes_sent_per_kind_as_the_algorithm_table_says():
    n, numel = 4, 1000
    for stats in run_ranks(_accounting, n, numel):
        b = 4 * numel
        assert stats["reduce_scatter"] == (2, 2 * (n - 1) * b // n, True)
        # ring (reduce-scatter + all-gather) sends 2(N-1)/N * B, exchange (N-1) * B
        assert stats["all_reduce"] == (2, 2 * (n - 1) * b // n + (n - 1) * b, True)
        assert stats["all_gather"][0] == 0 and stats["broadcast"][0] == 0


def _header_bytes(comm):
    plain, checked = comm.instrumented(check=False), comm.instrumented(check=True)
    for c in (plain, checked):
        collectives.broadcast(torch.ones(16), 0, c)
    return plain.stats.bytes_sent["broadcast"], checked.stats.bytes_sent["broadcast"]


def test_header_check_costs_one_small_message_per_peer():
    for _rank, (plain, checked) in enumerate(run_ranks(_header_bytes, 2)):
        assert checked - plain == 9 * 8  # nine int64 header words to the one peer (in its message)


# --------------------------------------------------------------------------- stall diagnosis


def _stall(comm, sleeper):
    short = dist.new_group(list(comm.ranks), timeout=datetime.timedelta(seconds=1.5))
    sub = Comm.subgroup(comm.ranks, short).instrumented(check=False)
    if comm.rank == sleeper:
        time.sleep(5)  # never joins the all_reduce below; the others give up after 1.5 s
        return "slept"
    began = time.monotonic()
    try:
        with watch("step 7", sub, 1.5):
            collectives.all_reduce(torch.ones(4), sub)
        return "no error"
    except StallError as exc:
        return str(exc), time.monotonic() - began


def _dead_and_blocked(comm):
    """Rank 1's announced process has exited; rank 2 is alive but sends nothing (as a survivor
    blocked on a peer that is itself in the roll call); rank 0's all_reduce times out."""
    short = dist.new_group(list(comm.ranks), timeout=datetime.timedelta(seconds=1.5))
    sub = Comm.subgroup(comm.ranks, short).instrumented(check=False)
    watchdog.announce()
    if comm.rank == 1:  # its record now names a process that has exited and been reaped
        gone = subprocess.Popen(["true"])
        gone.wait()
        record = {"host": socket.gethostname(), "pid": gone.pid}
        dist.distributed_c10d._get_default_store().set("distlib/proc/1", json.dumps(record))
    if comm.rank != 0:
        time.sleep(6)  # past rank 0's error (2.3 s) by more than the bound below
        return "away"
    time.sleep(0.5)  # rank 1's record is written
    began = time.monotonic()
    try:
        with watch("step 7", sub, 20.0):  # the grace of a 20 s timeout: 5 s
            collectives.all_reduce(torch.ones(4), sub)
        return "no error"
    except StallError as exc:
        return str(exc), time.monotonic() - began


@pytest.mark.serial
def test_a_dead_peer_ends_the_roll_call_without_waiting_out_the_grace():
    results = run_ranks(_dead_and_blocked, 3, timeout_s=60)
    msg, seconds = results[0]
    assert "rank(s) [1] did not arrive: their process(es) on this host exited" in msg, msg
    assert "(rank(s) [2] had not reported yet)" in msg, msg
    assert seconds < 1.5 + watchdog.SETTLE_S + 2.0, seconds  # not 1.5 + the 5 s grace


@pytest.mark.serial
def test_a_stalled_rank_is_named_by_the_ranks_that_waited_for_it():
    results = run_ranks(_stall, 3, 1, timeout_s=60)
    assert results[1] == "slept"
    for rank in (0, 2):
        msg, seconds = results[rank]
        assert msg.startswith("step 7: all_reduce did not complete on rank"), msg
        assert "rank(s) [1] did not arrive" in msg, msg
        assert seconds < 1.5 + 0.75 + 2.0, seconds  # the timeout, the grace, and slack
