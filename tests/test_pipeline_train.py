"""Pipeline parallelism in the training application (dist.pp): the layout is refused with one
line when it cannot work; every layout trains to world size 1's losses on the same global
batch under each schedule it is run with; checkpoints resume bitwise at the same layout and
across pipeline degrees."""

import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from ckpt_util import assert_same_files, assert_saved_final_state, state_of
from e2e import torchrun
from multiproc import run_ranks
from plan_check import matrix_misses

from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.runtime.faults import step_hooks
from distlib.app.trainer import Trainer
from distlib.checkpoint import offline
from distlib.checkpoint import sharded as checkpoint
from distlib.comm.layout import Layout
from distlib.comm.mesh import build_mesh
from distlib.launch.torchrun import use_deterministic_kernels

REL = 1e-5
# n_layers 2 x pp: pp x 2 virtual chunks; grad_accum 4 micro-batches (interleaved: a multiple of pp)
BASE = {
    "model": {"n_layers": 4, "dim": 16, "n_heads": 4},
    "train": {"steps": 20, "global_batch": 8, "grad_accum": 4},
    "checkpoint": {"every_steps": 0, "verify_resume": False},
    "metrics": {"progress_every": 0},
}
SCHEDULES = [
    {"pp_schedule": "gpipe"},
    {"pp_schedule": "1f1b"},
    {"pp_schedule": "interleaved", "pp_virtual": 2},
]


def tree(world: int, steps: int = 20, n_layers: int = 4, **dist) -> dict:
    t = {k: dict(v) for k, v in BASE.items()}
    t["train"]["steps"], t["model"]["n_layers"] = steps, n_layers
    t["dist"] = {"world_size": world, **dist}
    return t


@pytest.mark.parametrize(
    "dist, message",
    [
        ({"world_size": 4, "pp": 3}, "dist.pp=3 must be >= 1 and divide dist.world_size=4"),
        (
            {"world_size": 8, "tp": 2, "pp": 3},
            "dist.tp x dist.pp = 2 x 3 must be >= 1 and divide dist.world_size=8",
        ),
        ({"world_size": 4, "pp": 0}, "dist.pp must be an integer >= 1, got 0"),
        (
            {"world_size": 4, "pp": 4},
            "model.n_layers=2 does not split into dist.pp x dist.pp_virtual = 4 x 1 = 4",
        ),
        ({"world_size": 2, "pp": 2, "pp_schedule": "zigzag"}, "dist.pp_schedule must be one of"),
        ({"world_size": 2, "pp": 2, "pp_virtual": 2}, "dist.pp_virtual=2 needs dist.pp_schedule=interleaved"),
    ],
)
def test_a_pipeline_layout_that_cannot_work_is_one_config_error(dist, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"dist": dist})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_interleaving_needs_micro_batches_in_multiples_of_pp_and_blocks_for_every_chunk():
    with pytest.raises(
        ConfigError, match="train.grad_accum .micro-batches, 3. to be a multiple of dist.pp=2"
    ):
        RunConfig.from_dict(
            {
                "dist": {"world_size": 2, "pp": 2, "pp_schedule": "interleaved", "pp_virtual": 2},
                "model": {"n_layers": 4},
                "train": {"grad_accum": 3, "global_batch": 6},
            }
        )
    with pytest.raises(
        ConfigError, match="model.n_layers=2 does not split into dist.pp x dist.pp_virtual = 2 x 2"
    ):
        RunConfig.from_dict(
            {"dist": {"world_size": 2, "pp": 2, "pp_schedule": "interleaved", "pp_virtual": 2}}
        )
    cfg = RunConfig.from_dict({"dist": {"world_size": 8, "tp": 2, "pp": 2}, "train": {"global_batch": 8}})
    assert cfg.dp_size == 2  # 8 ranks = 2 tensor x 2 data x 2 pipeline


def _mesh(comm):
    mesh = build_mesh(comm.instrumented(check=True), Layout.of(comm.size, tp=2, pp=2))
    stats = {id(g.stats) for g in (mesh.world, mesh.dp, mesh.tp, mesh.pp, mesh.stage)}
    return {name: g.ranks for name, g in mesh.groups().items()} | {
        "stage": mesh.stage.ranks,
        "loss_ranks": mesh.loss_ranks,
        "ends": (mesh.first_stage, mesh.last_stage),
        "own_stats": len(stats) == 5,
        "checked": all(g.check for g in mesh.groups().values()),
    }


@pytest.mark.slow
def test_the_mesh_knows_data_tensor_and_pipeline_groups_in_the_documented_rank_order():
    got = run_ranks(_mesh, 8)
    place = {
        (s * 2 + d) * 2 + t: (s, d, t) for s in range(2) for d in range(2) for t in range(2)
    }  # tp fastest
    rank = {v: k for k, v in place.items()}
    for g, row in enumerate(got):
        s, d, t = place[g]
        assert row["tp"] == tuple(rank[s, d, x] for x in range(2))
        assert row["dp"] == tuple(rank[s, x, t] for x in range(2))
        assert row["pp"] == tuple(rank[x, d, t] for x in range(2))
        assert row["stage"] == tuple(rank[s, x, y] for x in range(2) for y in range(2))
        assert row["loss_ranks"] == tuple(rank[1, x, t] for x in range(2))  # the last stage's dp group
        assert row["ends"] == (s == 0, s == 1) and row["own_stats"] and row["checked"]


def _train(comm, trees: list[dict], run_dir: str) -> list[dict]:
    """One rank: train each tree in turn (one fork serves several schedules)."""
    use_deterministic_kernels()  # the product's switch: the same ATen flag, without torch._inductor
    out = []
    for i, t in enumerate(trees):
        d = Path(run_dir) / str(i)
        d.mkdir(parents=True, exist_ok=True)
        cfg = RunConfig.from_dict(t)
        trainer = Trainer(cfg, comm, d, hooks=step_hooks(cfg.fault, comm.rank))  # as train.py
        result = trainer.run()
        out.append(
            {
                "losses": {s.step: s.loss.hex() for s in result.steps},
                "stopped_by": result.stopped_by,
                "norms": [s.param_norms for s in result.steps],
                "state": state_of(trainer.optimizer),  # this rank's partition at the end
                "tree": t,  # (tests/plan_check.py)
                "memory": [row["measured"] for row in result.memory],
            }
        )
    return out


def losses(run: dict) -> dict[int, float]:
    return {k: float.fromhex(v) for k, v in run["losses"].items()}


@pytest.fixture(scope="module")
def world_one(tmp_path_factory):
    """World size 1's losses for a model of ``n_layers`` blocks (each computed once)."""
    cache = {}

    def losses_of(n_layers: int) -> dict[int, float]:
        if n_layers not in cache:
            run = run_ranks(_train, 1, [tree(1, n_layers=n_layers)], str(tmp_path_factory.mktemp("ref")))[0][
                0
            ]
            cache[n_layers] = losses(run)
        return cache[n_layers]

    return losses_of


# Every schedule at every layout of up to 4 ranks; the tensor-parallel mixes, the slowest cases
# here (8 ranks on 2 cores: ~13 s a schedule), run the schedules that interleave micro-batches.
@pytest.mark.slow
@pytest.mark.parametrize(
    "world, layout, schedules",
    [
        (2, {"pp": 2}, SCHEDULES),
        (4, {"pp": 4}, SCHEDULES),
        (4, {"pp": 2}, SCHEDULES),
        (4, {"pp": 2, "tp": 2}, SCHEDULES[1:]),
        (8, {"pp": 2, "tp": 2}, SCHEDULES[2:]),
    ],
    ids=["pp2", "pp4", "pp2xdp2", "pp2xtp2", "dp2xtp2xpp2"],
)
def test_every_layout_and_schedule_trains_to_world_size_ones_losses(
    tmp_path, world_one, world, layout, schedules
):
    n_layers = 2 * layout["pp"]
    runs = run_ranks(
        _train,
        world,
        [tree(world, n_layers=n_layers, **layout, **s) for s in schedules],
        str(tmp_path),
        timeout_s=900,
    )
    want = world_one(n_layers)
    assert len(runs[0]) == len(schedules)
    assert matrix_misses(runs[0]) == {}  # every rank's bytes as scripts/plan.py predicts them
    for schedule, run in zip(schedules, runs[0]):
        got = losses(run)
        assert sorted(got) == list(range(1, 21))
        worst = max(abs(got[k] - want[k]) / abs(want[k]) for k in got)
        assert worst <= REL, f"{layout} {schedule}: loss differs from world size 1 by {worst:.2e} (relative)"
    step = next(
        json.loads(line)
        for line in (tmp_path / "0" / "metrics.jsonl").read_text().splitlines()
        if '"type": "step"' in line
    )
    assert step["comm_bytes"]["pp"] > 0  # the pipeline group's traffic, reported apart
    for r in range(world):  # the parameter norm spans every stage: one value on every rank
        assert [run["norms"] for run in runs[r]] == [run["norms"] for run in runs[0]]
        assert all(len(set(norms)) == 1 for run in runs[r] for norms in run["norms"])


def _resumable(world: int, **dist) -> dict:
    t = tree(world, steps=6, **dist)
    t["checkpoint"] = {"every_steps": 3, "verify_resume": True}
    return t


def _run_then_resume(tmp_path, first: tuple[int, dict], second: tuple[int, dict]):
    """Train 6 steps (checkpoints 3 and 6) with ``first``; set step 6 aside; resume from step 3 with
    ``second``. Returns (uninterrupted run, resumed run, step-3 manifest), the runs by rank."""
    (w1, d1), (w2, d2) = first, second
    full = [r[0] for r in run_ranks(_train, w1, [_resumable(w1, **d1)], str(tmp_path), timeout_s=600)]
    root = tmp_path / "0" / "checkpoints"
    os.rename(root / "step_00000006", tmp_path / "step_00000006.aside")
    resumed_tree = _resumable(w2, **d2)
    resumed_tree["checkpoint"]["resume"] = "latest"
    resumed = [r[0] for r in run_ranks(_train, w2, [resumed_tree], str(tmp_path), timeout_s=600)]
    return full, resumed, checkpoint.read_manifest(root / "step_00000003")


@pytest.mark.slow
def test_a_pipeline_run_resumes_bitwise_and_its_manifest_records_the_stages(tmp_path):
    full_ranks, resumed_ranks, manifest = _run_then_resume(tmp_path, (2, {"pp": 2}), (2, {"pp": 2}))
    full, resumed = full_ranks[0], resumed_ranks[0]
    assert sorted(resumed["losses"]) == [4, 5, 6]
    assert resumed["losses"] == {k: full["losses"][k] for k in (4, 5, 6)}  # bit for bit
    # the step-3 reload restored everything: the resumed run saves step 6 byte for byte as the
    # uninterrupted run did, and each shard holds its rank's state at the end
    again, aside = tmp_path / "0" / "checkpoints" / "step_00000006", tmp_path / "step_00000006.aside"
    assert_same_files(again, aside)
    assert_saved_final_state(aside, full_ranks)
    assert_saved_final_state(again, resumed_ranks)
    assert (manifest["pp"], manifest["dp"], manifest["tp"], manifest["world_size"]) == (2, 1, 1, 2)
    stages = [[p["name"] for p in per_tp[0]["params"]] for per_tp in manifest["pp_layouts"]]
    assert stages[0][:2] == ["tok_emb.weight", "pos_emb.weight"] and stages[1][-1] == "lm_head.bias"
    assert {n.split(".")[1] for n in stages[0] if n.startswith("blocks.")} == {"0", "1"}
    assert {n.split(".")[1] for n in stages[1] if n.startswith("blocks.")} == {"2", "3"}
    # scripts/ckpt.py consolidate joins the stages: each tensor is its stage file's bytes
    step3 = tmp_path / "0" / "checkpoints" / "step_00000003"
    whole = safetensors.torch.load_file(offline.consolidate(step3, tmp_path / "out")[0])
    for s, per_tp in enumerate(manifest["pp_layouts"]):
        flat = checkpoint.load_shard(step3, s)[0]["master"]  # stage s's only rank
        for p in per_tp[0]["params"]:
            assert torch.equal(whole.pop(p["name"]).reshape(-1), flat[p["offset"] : p["offset"] + p["numel"]])
    assert not whole, f"consolidated tensors no stage holds: {sorted(whole)}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "first, second",
    [
        ((2, {"pp": 2}), (1, {})),  # pp2 -> pp1
        ((1, {}), (2, {"pp": 2})),  # pp1 -> pp2
        ((4, {"pp": 2}), (1, {})),  # pp2 x dp2 -> pp1 x dp1
        ((2, {"pp": 2}), (4, {"pp": 2, "pp_schedule": "gpipe"})),  # pp2 -> pp2 x dp2
        ((2, {"pp": 2}), (4, {"pp": 2, "tp": 2})),  # pp2 -> pp2 x tp2: another tensor-parallel degree
    ],
    ids=["pp2-pp1", "pp1-pp2", "pp2dp2-pp1dp1", "pp2-pp2dp2", "pp2-pp2tp2"],
)
def test_a_checkpoint_resumes_across_pipeline_degrees(tmp_path, first, second):
    full_ranks, resumed_ranks, _ = _run_then_resume(tmp_path, first, second)
    full, resumed = full_ranks[0], resumed_ranks[0]
    assert sorted(resumed["losses"]) == [4, 5, 6]
    for k in (4, 5, 6):
        want, got = float.fromhex(full["losses"][k]), float.fromhex(resumed["losses"][k])
        assert abs(got - want) <= REL * abs(want), f"step {k}: {got} after the resume, {want} without"
    assert_saved_final_state(tmp_path / "0" / "checkpoints" / "step_00000006", resumed_ranks)


@pytest.mark.slow
def test_a_sigterm_to_one_stage_saves_the_same_step_on_both_and_stops(tmp_path):
    t = _resumable(2, pp=2)
    t["fault"] = {"sigterm_rank": 1, "sigterm_step": 4}
    runs = run_ranks(_train, 2, [t], str(tmp_path), timeout_s=600)
    for (run,) in runs:
        assert run["stopped_by"] == "SIGTERM" and sorted(run["losses"]) == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "0" / "checkpoints").glob("step_*")) == [
        "step_00000003",
        "step_00000004",
    ]
    checkpoint.verify(tmp_path / "0" / "checkpoints" / "step_00000004")


@pytest.mark.slow
def test_a_stalled_stage_is_named_within_the_timeout_by_the_stage_waiting_on_it(tmp_path):
    """The pipeline group's waits are bounded by dist.timeout_s like the world's (a new gloo
    group's own default is 30 minutes): rank 1 stalls, rank 0's receive times out and names it."""
    proc = torchrun(
        tmp_path,
        "dist.world_size=2",
        "dist.pp=2",
        "dist.timeout_s=5",
        "fault.hang_rank=1",
        "fault.hang_step=3",
        nproc=2,
        timeout=240,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error [rank 0]")]
    assert errors and "step 3: pipeline did not complete on rank 0 within dist.timeout_s=5s" in errors[0], (
        proc.stderr[-3000:]
    )
    assert "rank(s) [1] did not arrive" in errors[0]
