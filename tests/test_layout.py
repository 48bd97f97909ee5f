"""The parallel layout (distlib/comm/layout.py): named dimensions, the one rank order, every group
from it, one line per impossible layout, and old manifests read in the same order."""

import itertools
import math

import pytest

from distlib.comm.layout import ORDER, Layout, LayoutError


def test_the_rank_order_is_pp_dp_cp_tp_with_tensor_ranks_neighbours():
    grid = Layout.of(16, tp=2, pp=2, cp=2)
    assert (grid.pp, grid.dp, grid.cp, grid.tp) == (2, 2, 2, 2) and ORDER == ("pp", "dp", "cp", "tp")
    expect = 0
    for s, d, c, t in itertools.product(range(2), repeat=4):  # slowest first
        assert grid.rank(pp=s, dp=d, cp=c, tp=t) == expect
        assert grid.coords(expect) == {"pp": s, "dp": d, "cp": c, "tp": t}
        expect += 1


@pytest.mark.parametrize("world, tp, pp, cp", [(8, 2, 2, 1), (12, 3, 1, 2), (8, 1, 4, 1), (6, 1, 1, 1)])
def test_groups_partition_the_world_and_vary_only_their_dimensions(world, tp, pp, cp):
    grid = Layout.of(world, tp=tp, pp=pp, cp=cp)
    for dims in [("tp",), ("dp",), ("pp",), ("cp",), ("dp", "cp"), ("dp", "cp", "tp")]:
        groups = grid.groups(dims)
        assert sorted(r for g in groups for r in g) == list(range(world)), dims
        for g in groups:
            assert len(g) == math.prod(getattr(grid, d) for d in dims)
            fixed = [{d: c for d, c in grid.coords(r).items() if d not in dims} for r in g]
            assert all(f == fixed[0] for f in fixed), (dims, g)


def test_the_old_3d_formula_and_a_manifest_without_the_record_agree():
    grid = Layout.of_manifest({"world_size": 8, "tp": 2, "pp": 2})
    assert all(
        grid.rank(pp=s, dp=d, tp=t) == (s * 2 + d) * 2 + t
        for s in range(2)
        for d in range(2)
        for t in range(2)
    )
    assert Layout.of_manifest({"world_size": 4, "parallel": grid.to_dict() | {"dp": 1}}) == Layout(
        pp=2, dp=1, tp=2
    )
    assert Layout.from_dict(grid.to_dict()) == grid


@pytest.mark.parametrize(
    "world, sizes, line",
    [
        (6, {"tp": 4}, "dist.tp=4 must be >= 1 and divide dist.world_size=6"),
        (8, {"tp": 3, "pp": 2}, "dist.tp x dist.pp = 3 x 2 must be >= 1 and divide dist.world_size=8"),
        (8, {"tp": 2, "cp": 3}, "dist.tp x dist.cp = 2 x 3 must be >= 1 and divide dist.world_size=8"),
        (8, {"tp": 0}, "dist.tp must be an integer >= 1, got 0"),
        (8, {"tp": 2, "ep": 3}, "dist.ep=3 must divide the batch ranks dp x cp = 4"),
    ],
)
def test_an_impossible_layout_is_one_line_naming_the_keys(world, sizes, line):
    with pytest.raises(LayoutError) as err:
        Layout.of(world, **sizes)
    assert str(err.value) == line


def test_a_record_in_another_rank_order_is_refused():
    with pytest.raises(LayoutError, match="rank order"):
        Layout.from_dict({"order": ["dp", "pp", "cp", "tp"], "pp": 1, "dp": 2, "cp": 1, "tp": 1})


@pytest.mark.parametrize("world, tp, cp, ep", [(8, 2, 1, 2), (8, 1, 2, 4), (12, 1, 2, 3), (4, 1, 1, 1)])
def test_expert_groups_split_the_batch_group(world, tp, cp, ep):
    grid = Layout.of(world, tp=tp, cp=cp, ep=ep)
    for r in range(world):
        batch, experts, replicas = (
            grid.group(r, ("dp", "cp")),
            grid.group(r, ("ep",)),
            grid.group(r, ("edp",)),
        )
        assert len(experts) == ep and len(replicas) == len(batch) // ep
        assert set(experts) | set(replicas) <= set(batch) and set(experts) & set(replicas) == {r}
        b = batch.index(r)  # neighbours in the batch group hold the other experts
        assert experts == batch[b - b % ep : b - b % ep + ep] and replicas == batch[b % ep :: ep]
    for kind in ("ep", "edp"):
        assert sorted(x for g in grid.groups((kind,)) for x in g) == list(range(world))
        for r in range(world):  # with tp: that group of every tensor-parallel rank of r's
            joined = {x for t in grid.group(r, ("tp",)) for x in grid.group(t, (kind,))}
            assert grid.group(r, (kind, "tp")) == tuple(sorted(joined))
            assert len(joined) == tp * len(grid.group(r, (kind,)))
    with pytest.raises(ValueError, match="unknown layout dimension"):
        grid.group(0, ("sp",))
    with pytest.raises(ValueError, match="an expert group takes only tp beside it"):
        grid.group(0, ("edp", "dp"))


def _mesh_groups(comm, cp, ep):
    import torch

    from distlib.comm import collectives
    from distlib.comm.mesh import build_mesh

    mesh = build_mesh(comm, Layout.of(comm.size, cp=cp, ep=ep))
    total = collectives.all_reduce(torch.tensor([float(comm.rank)]), mesh.batch, op="sum")
    named = {name: (mesh.group(name).ranks, mesh.group(name).rank) for name in NAMED}
    groups = {k: c.ranks for k, c in mesh.groups().items()}
    return groups, mesh.batch.ranks, mesh.loss_ranks, float(total), named


NAMED = ("tp", "dp", "pp", "cp", "ep", "edp", "batch", "stage")


def test_the_mesh_builds_the_batch_and_expert_groups_the_layout_names():
    from multiproc import run_ranks

    for cp, ep in [(2, 1), (1, 2), (2, 2)]:
        grid = Layout.of(4, cp=cp, ep=ep)
        for r, (groups, batch, loss_ranks, total, named) in enumerate(run_ranks(_mesh_groups, 4, cp, ep)):
            for name in NAMED:  # mesh.group(name): the layout's group, and this rank's place in it
                dims = {"batch": ("dp", "cp"), "stage": ("dp", "cp", "tp")}.get(name, (name,))
                assert named[name] == (grid.group(r, dims), grid.place(r, dims)), name
            assert batch == loss_ranks == grid.group(r, ("dp", "cp"))
            assert total == sum(batch), "a collective over the batch group spans dp x cp"
            assert groups["dp"] == grid.group(r, ("dp",))
            assert groups.get("cp", (r,)) == grid.group(r, ("cp",))
            assert groups.get("ep", (r,)) == grid.group(r, ("ep",))
            assert groups.get("edp", batch) == grid.group(r, ("edp",))
