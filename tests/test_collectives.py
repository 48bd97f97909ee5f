"""distlib.collectives against torch's own gloo collectives, on real forked gloo ranks.

Every algorithm is forced at small sizes (``algo=``), with a tiny pipeline segment so the
segmented ring / chain paths really run many segments. Float sums are compared two ways:
integer-valued data must match torch exactly (every partial sum is exact, so reduction
order cannot matter), random data within the reduction-order bound. After all_reduce,
broadcast and all_gather every rank must hold identical bytes; that is checked on random
data, where a rank-dependent summation order would show.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import time

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks

from distlib.comm import collectives as C
from distlib.comm.group import Comm

SIZES = (0, 1, 3, 7, 1000, 4099)
DTYPES = (torch.float32, torch.bfloat16)
OPS = ("sum", "avg", "max", "min")
TORCH_OP = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
RS_ALGOS, AG_ALGOS = ("direct", "ring", "halving"), ("direct", "ring", "bruck")
AR_ALGOS = ("exchange", "direct", "ring", "rabenseifner")
BCAST_ALGOS = ("flat", "tree", "chain", "scatter")
TINY_SEGMENT = 64  # bytes: 16 fp32 / 32 bf16 elements per pipeline segment


def _data(kind: str, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "int":  # small integers: every partial sum of <= 4 of them is exact, even in bf16
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g).to(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _reference(x: torch.Tensor, op: str, group=None) -> torch.Tensor:
    ref = x.clone()
    dist.all_reduce(ref, op=TORCH_OP[op], group=group)
    return ref / dist.get_world_size(group) if op == "avg" else ref


def _assert_reduced(got, ref, x, op, kind, comm, where, group=None, bounds=slice(None)):
    if kind == "int" or op in ("max", "min"):
        # exact: max/min ignore order; integer sums are exact; avg then divides once
        assert torch.equal(got, ref[bounds]), f"{where}: {got} != {ref[bounds]}"
        return
    # Any summation order of N terms errs by <= (N-1)*u*sum|x| (u = eps/2), so two orders differ
    # by <= (N-1)*eps*sum|x|; avg adds one rounding per side. N*eps*sum|x| covers both.
    absum = x.abs().double()
    dist.all_reduce(absum, group=group)
    n = comm.size
    tol = n * torch.finfo(x.dtype).eps * absum[bounds] / (n if op == "avg" else 1) + 1e-30
    err = (got.double() - ref[bounds].double()).abs()
    assert bool((err <= tol).all()), f"{where}: max err {err.max()} > tol"


def _case_name(*parts) -> str:
    return "/".join(str(p) for p in parts)


def _run_battery(comm: Comm, group=None, sizes=SIZES, dtypes=DTYPES) -> dict[str, str]:
    """Every collective x algorithm x size x dtype x op against torch on ``comm``.
    Returns {case: sha256 of the result} for the cases that must agree across ranks."""
    digests: dict[str, str] = {}
    seed0 = 1000 * comm.peer(comm.rank)
    for si, numel in enumerate(sizes):
        for dtype in dtypes:
            bounds = slice(*C.chunk_bounds(numel, comm.size)[comm.rank])
            for kind in ("int", "rand"):
                for op in OPS if kind == "int" else ("sum", "avg"):
                    x = _data(kind, numel, dtype, seed0 + si)
                    ref = _reference(x, op, group)
                    results = {}
                    for algo in AR_ALGOS:
                        where = _case_name("all_reduce", algo, numel, dtype, kind, op)
                        got = results[algo] = x.clone()
                        assert C.all_reduce(got, comm, op, algo=algo) is got
                        _assert_reduced(got, ref, x, op, kind, comm, where, group)
                        digests[where] = _digest(got)
                    # documented: exchange and direct both reduce in rank order 0..N-1
                    assert torch.equal(results["exchange"], results["direct"]), where
                    for algo in RS_ALGOS:
                        where = _case_name("reduce_scatter", algo, numel, dtype, kind, op)
                        before = x.clone()
                        got = C.reduce_scatter(x, comm, op, algo=algo)
                        assert torch.equal(x, before), f"{where}: input modified"
                        assert got.shape == (bounds.stop - bounds.start,) and got.dtype == dtype, where
                        _assert_reduced(got, ref, x, op, kind, comm, where, group, bounds)

            # all_gather: rank j's chunk is derived from seed j, so every rank knows the answer.
            full = torch.cat(
                [
                    _data("rand", numel, dtype, 7 + j)[slice(*b)]
                    for j, b in enumerate(C.chunk_bounds(numel, comm.size))
                ]
            )
            for algo in AG_ALGOS:
                for in_place in (False, True):
                    where = _case_name("all_gather", algo, in_place, numel, dtype)
                    out = torch.full((numel,), float("nan"), dtype=dtype)
                    chunk = out[bounds] if in_place else full[bounds].clone()
                    if in_place:
                        chunk.copy_(full[bounds])
                    assert C.all_gather(out, chunk, comm, algo=algo) is out
                    assert torch.equal(out, full), where
                    digests[where] = _digest(out)

            for algo in BCAST_ALGOS:
                for src in range(comm.size):
                    where = _case_name("broadcast", algo, src, numel, dtype)
                    x = _data("rand", numel, dtype, seed0 + 500 + src)  # differs on every rank
                    ref = x.clone()
                    dist.broadcast(ref, src=comm.peer(src), group=group)
                    assert C.broadcast(x, src, comm, algo=algo) is x
                    assert torch.equal(x, ref), where
                    digests[where] = _digest(x)

    payload = b"rank-%d:" % comm.rank + b"x" * (37 * comm.rank)  # rank 0 short, lengths differ
    got = C.all_gather_bytes(payload, comm)
    assert got[comm.rank] == payload and [len(p) for p in got] == [7 + 37 * j for j in range(comm.size)]
    digests["all_gather_bytes"] = hashlib.sha256(repr(got).encode()).hexdigest()
    assert C.all_gather_bytes(b"", comm) == [b""] * comm.size
    return digests


def _battery_rank(comm: Comm) -> dict[str, str]:
    C.SEGMENT_BYTES = TINY_SEGMENT
    return _run_battery(comm)


def _assert_identical(per_rank: list[dict[str, str]]) -> None:
    for case, digest in per_rank[0].items():
        differ = [r for r, d in enumerate(per_rank) if d[case] != digest]
        assert not differ, f"{case}: ranks {differ} hold different bytes than rank 0"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_algorithm_matches_torch(world):
    per_rank = run_ranks(_battery_rank, world, timeout_s=60)
    assert len(per_rank[0]) > 100
    _assert_identical(per_rank)


def _light_battery_rank(comm: Comm) -> dict[str, str]:
    C.SEGMENT_BYTES = TINY_SEGMENT
    return _run_battery(comm, sizes=(0, 5, 1000), dtypes=(torch.float32,))


@pytest.mark.parametrize("world", [5, 6, 7, 8])
def test_every_algorithm_matches_torch_up_to_8_ranks(world):
    """5-8 ranks (non-powers of two fold ranks into virtual ones; Bruck wraps around): fewer
    sizes and one dtype, so that 8 ranks stay fast on 2 cores."""
    per_rank = run_ranks(_light_battery_rank, world, timeout_s=120)
    assert len(per_rank[0]) > 50
    _assert_identical(per_rank)


def _more_dtypes_rank(comm: Comm) -> list[str]:
    """float64 / float16 / int32 / int64 through the default (size-chosen) algorithms, with the
    thresholds lowered so that 70001 elements take the large-tensor paths; and 2-D tensors."""
    checked = []
    C.SEGMENT_BYTES = 16 << 10
    # latency 256x cheaper: 70001 elements are priced like ~70 MB, so the large-tensor algorithms run
    m = C.MODEL
    C.MODEL = dataclasses.replace(
        m, alpha=m.alpha / 256, mu=m.mu / 256, nu=m.nu / 256, segment=C.SEGMENT_BYTES
    )
    assert C.choose_algorithm("all_reduce", 70_001 * 4, comm.size) not in ("exchange", "direct")
    for dtype in (torch.float64, torch.float16, torch.int32, torch.int64):
        for numel in (5, 70_001):  # 70001 x 2-8 bytes > every lowered threshold
            x = _data("int", numel, torch.float64, comm.rank).to(dtype)
            for op in ("sum", "max", "min") + (("avg",) if dtype.is_floating_point else ()):
                got = C.all_reduce(x.clone(), comm, op)
                assert torch.equal(got, _reference(x, op)), (dtype, numel, op)
                lo, hi = C.chunk_bounds(numel, comm.size)[comm.rank]
                assert torch.equal(C.reduce_scatter(x, comm, op), _reference(x, op)[lo:hi])
                checked.append(f"{dtype}/{numel}/{op}")
            if not dtype.is_floating_point:
                with pytest.raises(ValueError, match="avg"):
                    C.all_reduce(x.clone(), comm, "avg")
    for rows in (6, 7001):  # 7001 x 20 x 4 bytes: chain broadcast on 3 ranks
        x = _data("rand", rows * 20, torch.float32, comm.rank).reshape(rows, 20)
        ref = x.clone()
        dist.broadcast(ref, src=comm.size - 1)
        assert torch.equal(C.broadcast(x, comm.size - 1, comm), ref) and x.shape == (rows, 20)
    out = torch.empty(4 * comm.size, 3)  # even split: compare with all_gather_into_tensor too
    mine = torch.full((4, 3), float(comm.rank))
    expect = torch.empty_like(out)
    dist.all_gather_into_tensor(expect, mine)
    assert torch.equal(C.all_gather(out, mine, comm), expect)
    return checked


@pytest.mark.parametrize("world", [2, 3])
def test_other_dtypes_and_default_algorithms(world):
    checked = run_ranks(_more_dtypes_rank, world, timeout_s=60)[0]
    assert len(checked) == 2 * (4 + 4 + 3 + 3)


def _subgroup_rank(comm: Comm) -> dict[str, str]:
    # new_group must be called by every rank, in the same order, even by non-members.
    groups = {(1, 3): dist.new_group([1, 3]), (0, 2): dist.new_group([0, 2])}
    ranks = (1, 3) if comm.rank in (1, 3) else (0, 2)
    sub = Comm.subgroup(ranks, groups[ranks])
    C.SEGMENT_BYTES = TINY_SEGMENT
    # both subgroups run concurrently: messages must stay within their group
    return _run_battery(sub, group=groups[ranks], sizes=(0, 3, 1000), dtypes=(torch.float32,))


def test_subgroups_run_concurrently():
    per_rank = run_ranks(_subgroup_rank, 4, timeout_s=60)
    _assert_identical([per_rank[1], per_rank[3]])
    _assert_identical([per_rank[0], per_rank[2]])


def _timeout_rank(comm: Comm) -> list[str]:
    """Rank 1 never joins; rank 0 must get a RuntimeError naming collective, rank and peer."""
    messages = []
    calls = {
        "broadcast": lambda c: C.broadcast(torch.zeros(4), 1, c),
        "reduce_scatter": lambda c: C.reduce_scatter(torch.zeros(4), c),
        "all_gather": lambda c: C.all_gather(torch.zeros(4), torch.zeros(2), c),
        "all_reduce": lambda c: C.all_reduce(torch.zeros(4), c),
    }
    for _name, call in calls.items():
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=0.3))
        if comm.rank == 0:
            start = time.monotonic()
            with pytest.raises(RuntimeError) as info:
                call(Comm((0, 1), 0, group))
            # 0.3 s timeout; 3 s leaves room for a loaded machine, not for a wait the timeout missed
            assert time.monotonic() - start < 3, "the process group timeout did not bound the wait"
            assert info.value.__cause__ is not None, "original exception not chained"
            messages.append(str(info.value))
        dist.barrier()  # rank 1 stays alive (silent) until rank 0 has timed out
    return messages


@pytest.mark.serial
def test_hang_becomes_error_naming_collective_rank_and_peer():
    messages = run_ranks(_timeout_rank, 2)[0]
    for name, msg in zip(("broadcast", "reduce_scatter", "all_gather", "all_reduce"), messages):
        assert msg.startswith(name + ":") and "rank 0" in msg and "peer 1" in msg, msg
    assert len(messages) == 4


# ---------------------------------------------------------------- single process, no ranks


def test_chunk_bounds_match_tensor_split():
    for numel in (0, 1, 3, 7, 8, 1000, 4099):
        for parts in (1, 2, 3, 4, 5):
            pieces = torch.arange(numel).tensor_split(parts)
            assert [hi - lo for lo, hi in C.chunk_bounds(numel, parts)] == [len(p) for p in pieces]
            assert C.chunk_bounds(numel, parts)[0][0] == 0 and C.chunk_bounds(numel, parts)[-1][1] == numel


def test_world_of_one_is_a_copy_or_no_op():
    solo = Comm((0,), 0)
    x = torch.randn(7)
    rs = C.reduce_scatter(x, solo, "avg")
    assert torch.equal(rs, x) and rs.data_ptr() != x.data_ptr()
    y = x.clone()
    assert torch.equal(C.all_reduce(y, solo, "sum"), x)
    assert torch.equal(C.broadcast(y, 0, solo), x)
    out = torch.zeros(7)
    assert torch.equal(C.all_gather(out, x, solo), x)
    assert C.all_gather_bytes(b"abc", solo) == [b"abc"]


def test_bad_arguments_raise_value_error():
    solo = Comm((0,), 0)
    with pytest.raises(ValueError, match="prod"):
        C.all_reduce(torch.zeros(3), solo, "prod")
    with pytest.raises(ValueError, match="prod"):
        C.reduce_scatter(torch.zeros(3), solo, "prod")
    with pytest.raises(ValueError, match="avg"):
        C.reduce_scatter(torch.zeros(3, dtype=torch.int64), solo, "avg")
    with pytest.raises(ValueError, match="bogus"):
        C.all_gather(torch.zeros(3), torch.zeros(3), solo, algo="bogus")
    with pytest.raises(ValueError, match="expected 3"):
        C.all_gather(torch.zeros(3), torch.zeros(2), solo)
    with pytest.raises(ValueError, match="src"):
        C.broadcast(torch.zeros(3), 1, solo)
    with pytest.raises(ValueError, match="contiguous"):
        C.all_reduce(torch.zeros(3, 4).t(), solo)


def test_algorithm_choice_is_the_cost_models_cheapest_and_keeps_small_sums_in_rank_order():
    from distlib.comm import cost_model

    mib = 1 << 20
    for coll, algos in cost_model.CANDIDATES.items():
        for world in range(2, 9):
            for nbytes in (1 << k for k in range(4, 27)):
                got = C.choose_algorithm(coll, nbytes, world)
                costs = [cost_model.estimate(coll, a, nbytes, world) for a in algos]
                assert got in algos and cost_model.estimate(coll, got, nbytes, world) == min(costs), (
                    coll,
                    world,
                    nbytes,
                )
    # the golden runs' tensors (< 1 MiB) keep the rank-order fold 0..N-1 (exchange or direct) at
    # every world size, and the large ones leave exchange's (N-1) B per rank
    for world in range(2, 9):
        assert {C.choose_algorithm("all_reduce", 1 << k, world) for k in range(2, 20)} <= {
            "exchange",
            "direct",
        }
        assert C.choose_algorithm("all_reduce", 1 << 10, world) == "exchange"
        assert C.choose_algorithm("all_reduce", 64 * mib, world) != "exchange"
    # a model with cheaper latency moves the same size to the bandwidth-optimal algorithms
    cheap = cost_model.CostModel(alpha=0.0, mu=0.0, nu=0.0)
    assert cost_model.choose_algorithm("all_reduce", 4096, 4, cheap) != "exchange"
    with pytest.raises(ValueError):
        C.choose_algorithm("gather", 1, 2)


def test_cost_model_table_lists_every_candidate_and_collectives_dispatches_each():
    from distlib.comm import cost_model

    rows = [
        line.split("|")[1:3]
        for line in cost_model.__doc__.splitlines()
        if line.startswith("| ") and "---" not in line
    ]
    listed = {}
    for coll, algo in rows[1:]:
        listed.setdefault(coll.strip(), []).append(algo.strip())
    assert {k: tuple(v) for k, v in listed.items()} == cost_model.CANDIDATES
    solo = Comm((0,), 0)
    for algo in cost_model.CANDIDATES["all_reduce"]:
        assert torch.equal(C.all_reduce(torch.ones(3), solo, algo=algo), torch.ones(3))
    for algo in cost_model.CANDIDATES["broadcast"]:
        assert torch.equal(C.broadcast(torch.ones(3), 0, solo, algo=algo), torch.ones(3))
    for algo in cost_model.CANDIDATES["reduce_scatter"]:
        assert torch.equal(C.reduce_scatter(torch.ones(3), solo, algo=algo), torch.ones(3))
    for algo in cost_model.CANDIDATES["all_gather"]:
        assert torch.equal(C.all_gather(torch.zeros(3), torch.ones(3), solo, algo=algo), torch.ones(3))
