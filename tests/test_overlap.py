"""zero.overlap: the gradient sync starts in backward (stages 0-2) and ZeRO-3 prefetches the next
unit, on a communication thread -- checked against torch DDP on real gloo ranks, by hook order
(never by timing), and bitwise where it must be (ZeRO-3 prefetch; checkpoint resume)."""

from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks

from distlib.app.config.groups import OptimizerConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.data.batches import BatchPlan, GlobalBatches, make_corpus
from distlib.app.model.minigpt import build_model
from distlib.app.trainer import Trainer
from distlib.comm.group import Comm
from distlib.comm.p2p import CollectiveError
from distlib.comm.progress import Progress
from distlib.parallel.broadcast import broadcast_module_
from distlib.parallel.zero.stages import stage_optimizer

CFG = ModelConfig(vocab_size=33, seq_len=8, dim=16, n_heads=2, n_layers=2, mlp_ratio=3)  # P = 7,201
BUCKET = 700  # several buckets of whole modules


def _comm_threads():
    return [t for t in threading.enumerate() if t.name.startswith("distlib-comm")]


def _data(comm, accum):
    return GlobalBatches(
        make_corpus(1, 4096, CFG.vocab_size),
        CFG.seq_len,
        BatchPlan(2 * comm.size * accum, comm.size, accum),
        seed=3,
    )


def _ddp_grads(comm, accum, dtype=torch.float32):
    """torch DDP's averaged gradient of step 0 (no_sync on all but the last micro-batch), flat."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_model(CFG, seed=7).to(dtype))
    batches = _data(comm, accum).micro_batches(0, comm.rank)
    for i, (x, y) in enumerate(batches):
        if i < accum - 1:
            with model.no_sync():
                (model(x, y) / accum).backward()
        else:
            (model(x, y) / accum).backward()
    return torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])


def _ours(comm, stage, accum, overlap, dtype=torch.float32, steps=3):
    model = build_model(CFG, seed=7)
    broadcast_module_(model, comm)
    opt = stage_optimizer(
        model,
        comm,
        stage,
        OptimizerConfig(lr=3e-3).adamw,
        param_dtype=dtype,
        bucket_numel=BUCKET,
        overlap=overlap,
        grad_accum=accum,
    )
    data, grads, losses = _data(comm, accum), None, []
    for step in range(steps):
        for x, y in data.micro_batches(step, comm.rank):
            loss = model(x, y) / accum
            loss.backward()
        opt.sync_grads()
        if step == 0:
            grads = opt.synced_grad_partition().clone()
        opt.apply_update()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert not _comm_threads(), "a communication thread outlived the step"
    lo, hi = opt.layout.shard_range(comm.rank)
    return grads.numpy(), lo, hi, losses, opt.param_buffer.float().clone().numpy(), opt.layout.numel


def _compare_with_ddp(comm, stage, accum, dtype):
    ours, lo, hi, *_ = _ours(comm, stage, accum, True, dtype, steps=1)
    ref = _ddp_grads(comm, accum, dtype)
    ref = torch.cat([ref, ref.new_zeros(hi - ref.numel())]) if hi > ref.numel() else ref
    return ours, ref[lo:hi].numpy()


@pytest.mark.parametrize("stage,accum,world", [(0, 1, 3), (1, 1, 4), (0, 2, 2), (1, 2, 3), (2, 2, 3)])
def test_overlapped_sync_averages_like_torch_ddp(stage, accum, world):
    for ours, ref in run_ranks(_compare_with_ddp, world, stage, accum, torch.float32):
        torch.testing.assert_close(torch.from_numpy(ours), torch.from_numpy(ref), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("stage", [0, 1])
def test_overlapped_sync_in_bf16_matches_torch_ddp_in_bf16(stage):
    # torch DDP reduces the bf16 gradients in bf16; ours are accumulated and reduced in fp32, so the
    # tolerance is bf16's (a missing bucket or a wrong average is off by far more).
    for ours, ref in run_ranks(_compare_with_ddp, 2, stage, 1, torch.bfloat16):
        torch.testing.assert_close(torch.from_numpy(ours), torch.from_numpy(ref), rtol=2e-2, atol=1e-4)


def _trains_like_the_plain_sync(comm, stage):
    return [_ours(comm, stage, 2, overlap)[3:5] for overlap in (False, True)]


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_training_with_overlap_matches_training_without(stage):
    for (plain_losses, plain_params), (losses, params) in run_ranks(_trains_like_the_plain_sync, 3, stage):
        if stage == 3:  # prefetching only moves an all-gather earlier: bitwise the same
            assert losses == plain_losses and params.tobytes() == plain_params.tobytes()
        else:  # a bucket may pick another reduction algorithm than the whole buffer
            torch.testing.assert_close(
                torch.from_numpy(params), torch.from_numpy(plain_params), rtol=1e-5, atol=1e-6
            )


def _launch_order(comm, accum):
    """Which buckets' syncs were handed to the thread when the first layer's gradient (the last one
    backward produces) was about to be accumulated, per micro-batch."""
    model = build_model(CFG, seed=7)
    opt = stage_optimizer(
        model, comm, 1, OptimizerConfig().adamw, bucket_numel=BUCKET, overlap=True, grad_accum=accum
    )
    seen = []
    model.tok_emb.weight.register_hook(lambda g: seen.append(list(opt.overlapped.launch_log)))
    for x, y in _data(comm, accum).micro_batches(0, comm.rank):
        model(x, y).backward()
    last_bucket = opt.overlapped._bucket_of[0]
    everything_else = [b for b in range(len(opt.overlapped.buckets)) if b != last_bucket]
    opt.sync_grads()
    return seen, everything_else, list(opt.overlapped.launch_log)


def test_sync_starts_during_the_last_backward_only():
    for seen, everything_else, after in run_ranks(_launch_order, 2, 2):
        assert len(everything_else) >= 3
        assert seen[0] == []  # first micro-batch: accumulate only
        assert sorted(seen[1]) == everything_else  # last: all but the first layer's bucket
        assert sorted(after) == sorted(everything_else + [after[-1]])  # sync_grads launched the rest, once


def _prefetch_log(comm):
    model = build_model(CFG, seed=7)
    opt = stage_optimizer(model, comm, 3, OptimizerConfig().adamw, overlap=True)
    log, submit = [], opt.progress.submit
    opt.progress.submit = lambda fn, *a: (log.append((fn.__name__, a[0])), submit(fn, *a))[1]
    units = [model.tok_emb, model.pos_emb, *model.blocks, model.ln_f, model.lm_head]
    for k, unit in enumerate(units):  # registered after the optimizer's hooks, so they run after them
        unit.register_forward_pre_hook(lambda m, a, k=k: log.append(("forward", k)))
        unit.register_forward_hook(
            lambda m, a, out, k=k: [out.register_hook(lambda g: log.append(("backward", k)))] and None
        )
    x, y = _data(comm, 1).micro_batches(0, comm.rank)[0]
    model(x, y).backward()
    opt.sync_grads()
    return log, len(units)


def test_zero3_prefetches_the_next_unit_in_forward_and_the_previous_in_backward():
    for log, n in run_ranks(_prefetch_log, 2):
        for k in range(n - 1):  # forward: k+1's gather queued before k computes
            assert log.index(("_fill", k + 1)) < log.index(("forward", k)), (k, log)
        backward = log[log.index(("forward", n - 1)) :]
        for k in range(2, n):  # backward: k-1's before k computes (the two embeddings' start together)
            assert backward.index(("_fill", k - 1)) < backward.index(("backward", k)), (k, log)
        fills = [e for e in log if e[0] == "_fill"]
        # twice each, as without prefetch, except the last unit: kept from its forward to its backward
        assert sorted(fills) == sorted(2 * [("_fill", k) for k in range(n - 1)] + [("_fill", n - 1)]), fills


def test_a_failed_collective_on_the_thread_reaches_the_caller_and_stops_the_queue():
    progress, ran = Progress(Comm(ranks=(0, 1), rank=0)), []

    def fail():
        raise CollectiveError("all_reduce: rank 0 failed waiting on peer 1", "all_reduce", 1)

    ticket = progress.submit(fail)
    later = progress.submit(ran.append, 1)
    with pytest.raises(CollectiveError, match="waiting on peer 1"):
        ticket.wait()
    with pytest.raises(CollectiveError):
        later.wait()
    with pytest.raises(CollectiveError):
        progress.drain()
    assert ran == [] and not _comm_threads()


def test_an_idle_thread_lets_go_of_the_jobs_it_ran():
    # (held until the next job, the last bucket of a backward outlived its reduce-scatter)
    progress = Progress(Comm(ranks=(0, 1), rank=0))
    bucket = torch.zeros(1000)
    alive = weakref.ref(bucket)
    progress.submit(lambda b: b.add_(1), bucket).wait()
    del bucket
    try:
        for _ in range(500):  # (the thread lets go just after the job's ticket is done)
            if alive() is None:
                break
            time.sleep(0.01)
        assert alive() is None and _comm_threads()  # gone, while the thread idles on
    finally:
        progress.drain()


def test_zero_overlap_is_validated():
    with pytest.raises(ConfigError, match="zero.overlap must be true or false"):
        RunConfig.from_dict({"zero": {"overlap": "yes"}})
    with pytest.raises(ConfigError, match="fault.nan_grad_rank .* zero.overlap"):
        RunConfig.from_dict({"zero": {"overlap": True}, "fault": {"nan_grad_rank": 0, "nan_grad_step": 2}})


def _run(comm, tree, run_dir: Path):
    if comm.rank == 0:
        run_dir.mkdir(parents=True)
    from distlib.comm import agree

    agree.all_true(True, comm)
    return Trainer(RunConfig.from_dict(tree), comm, run_dir).run()


def _resume(comm, root: str, stage: int):
    tree = {
        "model": {"vocab_size": 30, "seq_len": 8, "dim": 16, "n_heads": 4, "n_layers": 2, "mlp_ratio": 2},
        "zero": {"stage": stage, "bucket_numel": 600, "overlap": True},
        "data": {"total_tokens": 4096},
        "train": {"steps": 4, "global_batch": 8, "grad_accum": 2},
        "dist": {"world_size": 2},
        "checkpoint": {"every_steps": 2, "verify_resume": True},  # not the capstone's model: opt in
    }
    first = _run(comm, tree, Path(root) / "first")
    ckpt = Path(root) / "first" / "checkpoints" / "step_00000002"
    resumed = _run(
        comm, {**tree, "checkpoint": {"every_steps": 0, "resume": str(ckpt)}}, Path(root) / "again"
    )
    within = all(
        row["measured"][k] <= row["expected"][k] + row["allowance"][k]
        for row in first.memory
        for k in row["expected"]
    )  # prefetch's memory is in the formula
    return (
        [s.loss for s in first.steps],
        [s.loss for s in resumed.steps],
        resumed.start_step,
        first.resume_check.ok,
        within,
    )


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_resume_with_overlap_is_bitwise(tmp_path, stage):
    for first, resumed, start, restored, within in run_ranks(_resume, 2, str(tmp_path), stage):
        assert restored and start == 2 and within
        assert resumed == first[2:]


def _mismatch_on_the_thread(comm):
    from distlib.comm import collectives
    from distlib.comm.p2p import CollectiveMismatchError

    checked = comm.instrumented(check=True)
    progress = Progress(checked)
    progress.submit(collectives.all_reduce, torch.ones(4), checked)  # matched: counted
    progress.submit(collectives.all_reduce, torch.ones(4 + checked.rank), checked)  # sizes differ
    try:
        progress.drain()
    except CollectiveMismatchError as exc:
        return str(exc), checked.stats.calls["all_reduce"], not _comm_threads()
    return None


def test_the_header_check_and_the_counters_work_on_the_thread():
    for message, calls, no_thread in run_ranks(_mismatch_on_the_thread, 2):
        assert "numel=4" in message and "numel=5" in message and calls == 2 and no_thread


def _peer_gone(comm):
    from distlib.comm import collectives, watchdog

    if comm.rank == 1:
        return None  # leaves without joining: rank 0's queued all-reduce fails
    progress = Progress(comm)
    try:
        with watchdog.watch("step 7", comm, 5.0):
            progress.submit(collectives.all_reduce, torch.ones(8), comm)
            progress.drain()
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    return None


def test_a_peer_lost_during_a_queued_collective_reaches_the_watchdog():
    (kind, message), _ = run_ranks(_peer_gone, 2, timeout_s=20)
    assert kind == "StallError" and "step 7" in message and "all_reduce" in message, message
