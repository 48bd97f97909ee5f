"""The one relayout (distlib/checkpoint/relayout.py): a checkpoint of any layout loads into any other
bit for bit, reading only the files that hold what a rank needs.

The checkpoints here are written the way the trainer writes them (one flat layout per pipeline
stage and tensor rank, partitioned over the batch ranks dp x cp, files in the layout's rank order,
the manifest's ``tp_layouts``/``pp_layouts`` from ``tensor_parallel.manifest_layouts``), from
whole tensors whose every element is distinct; what a rank of another layout must get is built
the same way from the same whole tensors. The planner shares none of that construction: it works
from the manifest's names, offsets and splits alone.
"""

from __future__ import annotations

import itertools
import math

import pytest
import safetensors
import torch

from distlib.checkpoint import offline, relayout, sharded
from distlib.checkpoint.relayout import Place
from distlib.checkpoint.sharded import CheckpointError
from distlib.comm.layout import Layout
from distlib.parallel.adamw import STATE_KEYS
from distlib.parallel.flat_layout import FlatLayout, ParamSlot
from distlib.parallel.tensor_parallel import Split, manifest_layouts, shard_of

# (name, whole shape, tensor-parallel cut: (dim, groups) or None), in the model's order: two halves
# (pp 2 cuts between them), each with 4 experts. A fused q|k|v (3 groups along dim 0), row-parallel
# weights (dim 1), a column bias, replicated norms, and an empty parameter; 4 divides every cut.
EXPERTS = [(f"b{b}.experts.{e}", (4, 4), (1, 1)) for b in range(2) for e in range(4)]
PARAMS = [
    ("emb", (5, 4), None),
    ("qkv", (12, 4), (0, 3)),
    ("proj", (4, 4), (1, 1)),
    ("norm", (4,), None),
    *EXPERTS[:4],
    ("empty", (0,), None),
    ("fc", (8, 4), (0, 1)),
    ("fc_bias", (8,), (0, 1)),
    ("out", (4, 8), (1, 1)),
    *EXPERTS[4:],
    ("final_norm", (4,), None),
    ("head", (4, 4), (0, 1)),
]
PREFIX = "experts."  # the expert group's keys in a shard

# 17 layouts (pp, dp, cp, tp, ep): one rank; data, context, tensor, pipeline and expert parallelism
# alone and together; 3 and 7 batch ranks (uneven partitions, and empty ones: 7 ranks over a stage
# of few elements). ZeRO's stage leaves the files as a layout of these writes them. With ep the
# experts of each expert rank are a flat layout of their own, partitioned over the ranks holding
# them (the batch places b with b % ep the same), under PREFIX; without, every expert is in the
# one layout, as expert-parallel checkpoints were written before group_holdings.
LAYOUTS = [
    (1, 1, 1, 1, 1),
    (1, 2, 1, 1, 1),
    (1, 4, 1, 1, 1),
    (1, 3, 1, 1, 1),
    (1, 7, 1, 1, 1),
    (1, 2, 2, 1, 1),
    (1, 1, 4, 1, 1),
    (1, 1, 1, 2, 1),
    (1, 2, 1, 2, 1),
    (1, 1, 2, 2, 1),
    (2, 1, 1, 1, 1),
    (2, 2, 1, 1, 1),
    (2, 1, 1, 2, 1),
    (1, 4, 1, 1, 2),
    (1, 4, 1, 1, 4),
    (2, 2, 1, 1, 2),
    (1, 2, 1, 2, 2),
]


def _whole(key: str) -> dict[str, torch.Tensor]:
    """Each parameter's whole tensor of state ``key``: every element of every key distinct."""
    base = 1000.0 * STATE_KEYS.index(key)
    out, at = {}, 0
    for name, shape, _ in PARAMS:
        n = math.prod(shape)
        out[name] = (torch.arange(at, at + n, dtype=torch.float32) + base + 0.25).view(shape)
        at += n
    return out


def _stages(pp: int) -> list[list[tuple]]:
    cut = -(-len(PARAMS) // pp)
    return [PARAMS[s * cut : (s + 1) * cut] for s in range(pp)]


def _splits(params: list[tuple], tp: int, t: int) -> dict[str, Split]:
    return {name: Split(cut[0], tp, t, cut[1]) for name, _, cut in params if cut and tp > 1}


def _flat_layout(params: list[tuple], splits: dict[str, Split], world: int) -> FlatLayout:
    slots, offset = [], 0
    for name, shape, _ in params:
        local = tuple(shard_of(torch.zeros(shape), splits.get(name)).shape)
        slots.append(ParamSlot(name, local, offset))
        offset += math.prod(local)
    return FlatLayout(tuple(slots), world)


def _partition(key: str, layout: FlatLayout, splits: dict[str, Split], b: int) -> torch.Tensor:
    """Partition ``b`` of state ``key`` over ``layout``: what that rank holds (padding zero)."""
    flat = torch.zeros(layout.padded_numel)
    whole = _whole(key)
    for slot in layout.slots:
        flat[slot.offset : slot.offset + slot.numel] = shard_of(
            whole[slot.name], splits.get(slot.name)
        ).reshape(-1)
    return flat[slice(*layout.shard_range(b))].clone()


def _groups(stage: list[tuple], ep: int, j: int) -> dict[str, list[tuple]]:
    """key prefix -> the parameters of ``stage`` expert rank ``j`` of ``ep`` holds in that group."""
    if ep == 1:
        return {"": stage}
    held = {f".experts.{e}" for e in range(4) if e // (4 // ep) == j}
    experts = [p for p in stage if any(p[0].endswith(h) for h in held)]
    return {"": [p for p in stage if ".experts." not in p[0]], PREFIX: experts}


def _places(spec: tuple[int, ...]):
    """(file rank, {prefix: Place}, expected state) of every rank of the layout ``spec``."""
    pp, dp, cp, tp, ep = spec
    grid = Layout.of(pp * dp * cp * tp, pp=pp, cp=cp, tp=tp).partitions()
    for s, stage in enumerate(_stages(pp)):
        for t in range(tp):
            for b in range(dp * cp):
                places, expected = {}, {}
                for prefix, params in _groups(stage, ep, b % ep).items():
                    rank, world = (b, dp * cp) if prefix == "" else (b // ep, dp * cp // ep)
                    splits = _splits(params, tp, t)
                    layout = _flat_layout(params, splits, world)
                    places[prefix] = Place(layout, rank, world, splits, s, pp, t, tp)
                    expected |= {prefix + k: _partition(k, layout, splits, rank) for k in STATE_KEYS}
                yield grid.rank(pp=s, dp=b, tp=t), places, expected


def _group_holdings(spec: tuple[int, ...]) -> list[dict]:
    """The manifest's record of the expert layouts: which files hold each one's partitions."""
    pp, dp, cp, tp, ep = spec
    if ep == 1:
        return []
    grid = Layout.of(pp * dp * cp * tp, pp=pp, cp=cp, tp=tp).partitions()
    out = []
    for s, stage in enumerate(_stages(pp)):
        for t in range(tp):
            for j in range(ep):
                params = _groups(stage, ep, j)[PREFIX]
                layout = _flat_layout(params, _splits(params, tp, t), dp * cp // ep).to_dict()
                layout = manifest_layouts(layout, _splits(params, tp, t))[t] if tp > 1 else layout
                files = [grid.rank(pp=s, dp=i * ep + j, tp=t) for i in range(dp * cp // ep)]
                out.append({"prefix": PREFIX, "tp_rank": t, "layout": layout, "files": files})
    return out


def _write(path, spec: tuple[int, ...]) -> dict:
    """A committed checkpoint of layout ``spec`` at ``path``; returns its verified manifest."""
    pp, dp, cp, tp, ep = spec
    sharded.begin(path)
    partial, files = sharded.partial_dir(path), {}
    for rank, _, state in _places(spec):
        rng = {"rng.torch": torch.tensor([rank], dtype=torch.uint8)}
        rank_state = {"rng": {"rank": rank}, "optimizer_steps": 7}
        files[rank] = sharded.write_shard(partial, rank, {**state, **rng}, rank_state)
    per_stage = []
    for stage in _stages(pp):
        dense = _groups(stage, ep, 0)[""]
        layout = _flat_layout(dense, _splits(dense, tp, 0), dp * cp)
        per_stage.append(manifest_layouts(layout.to_dict(), _splits(dense, tp, 0)))
    world = pp * dp * cp * tp
    manifest = {"format_version": 1, "step": 4, "world_size": world, "zero_stage": 1, "model": {}}
    manifest |= {"tp": tp, "pp": pp, "parallel": Layout.of(world, pp=pp, cp=cp, tp=tp, ep=ep).to_dict()}
    manifest |= {"layout": per_stage[0][0], "files": [files[r] for r in range(world)]}
    manifest |= {"tp_layouts": per_stage[0]} if tp > 1 else {}
    manifest |= {"pp_layouts": per_stage} if pp > 1 else {}
    manifest |= {"group_holdings": _group_holdings(spec)} if ep > 1 else {}
    sharded.commit(partial, path, manifest)
    return sharded.verify(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("layouts")
    return {
        spec: (root / "x".join(map(str, spec)), _write(root / "x".join(map(str, spec)), spec))
        for spec in LAYOUTS
    }


def test_every_layout_loads_into_every_other_bit_for_bit(saved):
    for source, target in itertools.product(LAYOUTS, LAYOUTS):
        path, manifest = saved[source]
        for rank, places, expected in _places(target):
            state = relayout.load(path, manifest, places)[0]
            assert state.keys() == expected.keys()
            for key in state:
                assert torch.equal(state[key], expected[key]), (source, target, rank, key)


def test_a_rank_reads_only_the_files_that_hold_its_elements(saved):
    """At the same layout a rank reads its own file; at another, the files whose partitions overlap."""
    for spec in LAYOUTS:
        path, manifest = saved[spec]
        sources = relayout.Sources(relayout.holdings(manifest), path)
        for rank, places, expected in _places(spec):
            for prefix, place in places.items():
                planned = {file for file, _ in relayout.plan(sources, place)}
                assert planned <= {rank}, (spec, rank, prefix, sorted(planned))
                assert (rank in planned) == bool(expected[prefix + "master"].count_nonzero())
    path, manifest = saved[(1, 4, 1, 1, 1)]  # 4 partitions read as 2: rank 0 needs files 0 and 1
    planned = relayout.plan(
        relayout.Sources(relayout.holdings(manifest), path), Place(_flat_layout(PARAMS, {}, 2), 0, 2)
    )
    assert {file for file, _ in planned} == {0, 1}


def test_rng_state_carries_over_only_to_the_same_place(saved):
    """The rank at the same (stage, batch, tensor) place of the same pp and tp takes that file's RNG."""
    for source, target in itertools.product(LAYOUTS, LAYOUTS):
        path, manifest = saved[source]
        grid = Layout.of_manifest(manifest).partitions()
        for _, places, _ in _places(target):
            place = places[""]
            state, rng = relayout.rank_state(path, manifest, place)
            assert state["optimizer_steps"] == 7
            same = (source[0], source[3]) == (target[0], target[3]) and place.rank < grid.dp
            if not same:
                assert rng is None and state["rng"] is None, (source, target)
                continue
            own = grid.rank(pp=place.stage, dp=place.rank, tp=place.tp_rank)
            assert rng["rng.torch"].tolist() == [own] and state["rng"] == {"rank": own}


def test_full_tensors_and_the_offline_tools_read_every_layout(saved, tmp_path):
    whole = {key: _whole(key) for key in STATE_KEYS}
    names = [name for name, _, _ in PARAMS]
    for spec in LAYOUTS:
        path, manifest = saved[spec]
        for key in STATE_KEYS:
            got = relayout.full_tensors(path, manifest, key)
            assert sorted(got) == sorted(names) and (list(got) == names or spec[4] > 1)  # the model's order
            assert all(torch.equal(got[n], whole[key][n]) for n in got), (spec, key)
    # reshard: a pipeline x tensor-parallel checkpoint becomes a 3-rank data-parallel one
    out = offline.reshard_checkpoint(saved[(2, 1, 1, 2, 1)][0], tmp_path / "step_00000004", 3)
    resharded = sharded.verify(out)
    assert (resharded["world_size"], resharded["tp"], resharded.get("pp", 1)) == (3, 1, 1)
    for rank, _, expected in _places((1, 3, 1, 1, 1)):
        with safetensors.safe_open(str(out / sharded.shard_name(rank)), framework="pt") as f:
            assert all(torch.equal(f.get_tensor(k), expected[k]) for k in STATE_KEYS)
            assert "rng.torch" not in f.keys()  # other places: re-seeded on load
    # and a data-parallel one keeps rank r's RNG for the ranks it had
    out = offline.reshard_checkpoint(saved[(1, 2, 1, 1, 1)][0], tmp_path / "step_00000005", 3)
    rngs = [sharded.load_shard(out, r)[0].get("rng.torch") for r in range(3)]
    assert [None if t is None else t.tolist() for t in rngs] == [[0], [1], None]
    # an expert-parallel pipeline becomes one holding: every expert in it, no group left
    out = offline.reshard_checkpoint(saved[(2, 2, 1, 1, 2)][0], tmp_path / "step_00000006", 2)
    resharded = sharded.verify(out)
    assert "group_holdings" not in resharded and len(relayout.holdings(resharded)) == 1
    for key in STATE_KEYS:
        got = relayout.full_tensors(out, resharded, key)
        assert sorted(got) == sorted(names) and all(torch.equal(got[n], whole[key][n]) for n in got)


def test_a_missing_or_misshapen_parameter_is_named(saved):
    path, manifest = saved[(1, 2, 1, 1, 1)]
    layout = FlatLayout((ParamSlot("emb", (5, 4), 0), ParamSlot("nowhere", (3,), 20)), 1)
    with pytest.raises(CheckpointError, match="has no parameter nowhere"):
        relayout.read_partition(path, manifest, Place(layout))
    layout = FlatLayout((ParamSlot("emb", (4, 5), 0),), 1)
    with pytest.raises(CheckpointError, match=r"parameter emb has shape \[5, 4\], the model's is \[4, 5\]"):
        relayout.read_partition(path, manifest, Place(layout))
