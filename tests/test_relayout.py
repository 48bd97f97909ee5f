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

# (name, whole shape, tensor-parallel cut: (dim, groups) or None), in the model's order. A fused
# q|k|v (3 groups along dim 0), a row-parallel weight (dim 1), a column bias, replicated norms, and
# an empty parameter; 4 divides every cut.
PARAMS = [
    ("emb", (5, 4), None),
    ("qkv", (12, 4), (0, 3)),
    ("proj", (4, 4), (1, 1)),
    ("norm", (4,), None),
    ("empty", (0,), None),
    ("fc", (8, 4), (0, 1)),
    ("fc_bias", (8,), (0, 1)),
    ("out", (4, 8), (1, 1)),
    ("final_norm", (4,), None),
]

# 13 layouts (pp, dp, cp, tp): one rank; data, context, tensor and pipeline parallelism alone and
# together; 3 and 7 batch ranks (uneven partitions, and empty ones: 7 ranks over a stage of few
# elements). ZeRO's stage and expert parallelism leave the files as a layout of these writes them.
LAYOUTS = [
    (1, 1, 1, 1),
    (1, 2, 1, 1),
    (1, 4, 1, 1),
    (1, 3, 1, 1),
    (1, 7, 1, 1),
    (1, 2, 2, 1),
    (1, 1, 4, 1),
    (1, 1, 1, 2),
    (1, 2, 1, 2),
    (1, 1, 2, 2),
    (2, 1, 1, 1),
    (2, 2, 1, 1),
    (2, 1, 1, 2),
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


def _splits(stage: list[tuple], tp: int, t: int) -> dict[str, Split]:
    return {name: Split(cut[0], tp, t, cut[1]) for name, _, cut in stage if cut and tp > 1}


def _flat_layout(stage: list[tuple], splits: dict[str, Split], world: int) -> FlatLayout:
    slots, offset = [], 0
    for name, shape, _ in stage:
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


def _places(spec: tuple[int, int, int, int]):
    """(file rank, Place, expected state) of every rank of the layout ``spec``."""
    pp, dp, cp, tp = spec
    grid = Layout.of(pp * dp * cp * tp, pp=pp, cp=cp, tp=tp).partitions()
    for s, stage in enumerate(_stages(pp)):
        for t in range(tp):
            splits = _splits(stage, tp, t)
            layout = _flat_layout(stage, splits, dp * cp)
            for b in range(dp * cp):
                place = Place(layout, b, dp * cp, splits, s, pp, t, tp)
                expected = {key: _partition(key, layout, splits, b) for key in STATE_KEYS}
                yield grid.rank(pp=s, dp=b, tp=t), place, expected


def _write(path, spec: tuple[int, int, int, int]) -> dict:
    """A committed checkpoint of layout ``spec`` at ``path``; returns its verified manifest."""
    pp, dp, cp, tp = spec
    sharded.begin(path)
    partial, files = sharded.partial_dir(path), {}
    for rank, _, state in _places(spec):
        rng = {"rng.torch": torch.tensor([rank], dtype=torch.uint8)}
        rank_state = {"rng": {"rank": rank}, "optimizer_steps": 7}
        files[rank] = sharded.write_shard(partial, rank, {**state, **rng}, rank_state)
    per_stage = []
    for stage in _stages(pp):
        layout = _flat_layout(stage, _splits(stage, tp, 0), dp * cp)
        per_stage.append(manifest_layouts(layout.to_dict(), _splits(stage, tp, 0)))
    world = pp * dp * cp * tp
    manifest = {"format_version": 1, "step": 4, "world_size": world, "zero_stage": 1, "model": {}}
    manifest |= {"tp": tp, "pp": pp, "parallel": Layout.of(world, pp=pp, cp=cp, tp=tp).to_dict()}
    manifest |= {"layout": per_stage[0][0], "files": [files[r] for r in range(world)]}
    manifest |= {"tp_layouts": per_stage[0]} if tp > 1 else {}
    manifest |= {"pp_layouts": per_stage} if pp > 1 else {}
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
        for _, place, expected in _places(target):
            state = relayout.read_partition(path, manifest, place)
            for key in STATE_KEYS:
                assert torch.equal(state[key], expected[key]), (
                    source,
                    target,
                    place.stage,
                    place.tp_rank,
                    key,
                )


def test_a_rank_reads_only_the_files_that_hold_its_elements(saved):
    """At the same layout a rank reads its own file; at another, the files whose partitions overlap."""
    for spec in LAYOUTS:
        path, manifest = saved[spec]
        sources = relayout.Sources(relayout.holdings(manifest), path)
        for rank, place, expected in _places(spec):
            planned = relayout.plan(sources, place)
            assert set(planned) <= {rank}, (spec, rank, sorted(planned))
            assert (rank in planned) == bool(expected["master"].count_nonzero())
    path, manifest = saved[(1, 4, 1, 1)]  # 4 partitions read as 2: rank 0 needs files 0 and 1 only
    layout = _flat_layout(PARAMS, {}, 2)
    assert set(relayout.plan(relayout.Sources(relayout.holdings(manifest), path), Place(layout, 0, 2))) == {
        0,
        1,
    }


def test_rng_state_carries_over_only_to_the_same_place(saved):
    """The rank at the same (stage, batch, tensor) place of the same pp and tp takes that file's RNG."""
    for source, target in itertools.product(LAYOUTS, LAYOUTS):
        path, manifest = saved[source]
        grid = Layout.of_manifest(manifest).partitions()
        for _, place, _ in _places(target):
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
    for spec in LAYOUTS:
        path, manifest = saved[spec]
        for key in STATE_KEYS:
            got = relayout.full_tensors(path, manifest, key)
            assert list(got) == [name for name, _, _ in PARAMS]  # the model's order
            assert all(torch.equal(got[n], whole[key][n]) for n in got), (spec, key)
    # reshard: a pipeline x tensor-parallel checkpoint becomes a 3-rank data-parallel one
    out = offline.reshard_checkpoint(saved[(2, 1, 1, 2)][0], tmp_path / "step_00000004", 3)
    resharded = sharded.verify(out)
    assert (resharded["world_size"], resharded["tp"], resharded.get("pp", 1)) == (3, 1, 1)
    for rank, _, expected in _places((1, 3, 1, 1)):
        with safetensors.safe_open(str(out / sharded.shard_name(rank)), framework="pt") as f:
            assert all(torch.equal(f.get_tensor(k), expected[k]) for k in STATE_KEYS)
            assert "rng.torch" not in f.keys()  # other places: re-seeded on load
    # and a data-parallel one keeps rank r's RNG for the ranks it had
    out = offline.reshard_checkpoint(saved[(1, 2, 1, 1)][0], tmp_path / "step_00000005", 3)
    rngs = [sharded.load_shard(out, r)[0].get("rng.torch") for r in range(3)]
    assert [None if t is None else t.tolist() for t in rngs] == [[0], [1], None]


def test_a_missing_or_misshapen_parameter_is_named(saved):
    path, manifest = saved[(1, 2, 1, 1)]
    layout = FlatLayout((ParamSlot("emb", (5, 4), 0), ParamSlot("nowhere", (3,), 20)), 1)
    with pytest.raises(CheckpointError, match="has no parameter nowhere"):
        relayout.read_partition(path, manifest, Place(layout))
    layout = FlatLayout((ParamSlot("emb", (4, 5), 0),), 1)
    with pytest.raises(CheckpointError, match=r"parameter emb has shape \[5, 4\], the model's is \[4, 5\]"):
        relayout.read_partition(path, manifest, Place(layout))
