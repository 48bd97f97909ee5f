"""The capstone run (4 ranks, ZeRO-1, 20 steps) end to end, with its four invariants checked
independently of the program's own checks: from the files it writes, from its output, (invariant 2)
from parameter norms the test computes itself on every rank of a forked run of the same config, and
(invariant 4) from a forked resume of its step-10 checkpoint compared with the run bit for bit."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from ckpt_util import assert_same_files
from multiproc import run_ranks
from trainrun import compose_tree, train

import distlib.app.trainer as trainer_module
from distlib.app.config.run import RunConfig
from distlib.app.model.minigpt import build_model
from distlib.app.runtime.hooks import StepHooks
from distlib.app.trainer import Trainer
from distlib.launch.torchrun import use_deterministic_kernels

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def capstone(capstone_run):
    """README's capstone command, run once for this file and tests/test_readme_commands.py (conftest.py)."""
    return capstone_run


def test_capstone_exits_zero_and_prints_everything(capstone):
    proc, run_dir = capstone
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.rstrip().endswith("RESUME VERIFIED")
    table = [line for line in out.splitlines() if line[:4].strip().isdigit() and len(line.split()) == 5]
    assert [int(line.split()[0]) for line in table] == list(range(1, 21)), "20-row loss table"
    memory_rows = [line for line in out.splitlines() if line.rstrip().endswith((" yes", " NO"))]
    assert len(memory_rows) == 4 and all(r.rstrip().endswith("yes") for r in memory_rows)
    assert "checkpoint manifest: step 10, world size 4, ZeRO stage 1" in out
    assert out.count("RESUME VERIFIED") == 1, "only rank 0 prints"


def test_invariant_1_loss_decreases_monotonically(capstone):
    _, run_dir = capstone
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["type"] == "step"]  # (events are logged too)
    assert len(losses) == 20
    assert all(b <= a * (1 + 1e-6) for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0]


class _NormProbe(StepHooks):
    """The L2 norm of this rank's own parameter values right after each update, in float64 (the
    definition, not the program's float32 partition sums), kept per step as float hex."""

    def __init__(self) -> None:
        self.norms: dict[int, str] = {}
        self._pending: tuple[int, str] | None = None

    def after_update(self, step, parts):
        ((params, slots, start),) = parts
        assert start == 0, "ZeRO-1: every rank holds every parameter"
        own = torch.cat([params[s.offset : s.offset + s.numel] for s in slots])  # padding left out
        self._pending = (step, own.double().norm().item().hex())

    def after_step(self, step):
        # only a step that completed (was logged) counts; a rolled-back one never reaches here
        assert self._pending is not None and self._pending[0] == step
        self.norms[step], self._pending = self._pending[1], None


def _capstone_rank(comm, tree: dict, run_dir: str) -> dict:
    """One rank of the capstone, as train.py runs it, with the probe attached instead of the (no-op)
    fault hooks."""
    use_deterministic_kernels()
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    cfg = RunConfig.from_dict(tree)
    assert not cfg.fault.configured
    probe = _NormProbe()
    result = Trainer(cfg, comm, Path(run_dir), hooks=probe).run()
    return {
        "ours": probe.norms,
        "steps": [s.step for s in result.steps],
        "reported": [s.param_norms for s in result.steps],
        "rollbacks": len(result.rollbacks),
    }


def test_invariant_2_every_rank_has_the_same_parameter_norm(capstone, tmp_path):
    tree = compose_tree([])  # README's command: no overrides
    assert (tree["dist"]["world_size"], tree["zero"]["stage"], tree["train"]["steps"]) == (4, 1, 20)
    run_dir = tmp_path / "run"
    ranks = run_ranks(_capstone_rank, 4, tree, str(run_dir))
    assert all(r["steps"] == list(range(1, 21)) and r["rollbacks"] == 0 for r in ranks)
    for step in range(1, 21):
        ours = [r["ours"][step] for r in ranks]
        assert len(set(ours)) == 1, f"step {step}: ranks' parameter norms differ: {ours}"
    # The program's own report: every rank holds the same per-rank norms, and each is the norm this
    # test computed on that rank. The program sums float32 squares by partition, so it differs from
    # the float64 norm by float32 rounding (measured: 0.6 float32 eps at most); allow 4 eps.
    reported = ranks[0]["reported"]
    assert all(r["reported"] == reported for r in ranks)
    eps = torch.finfo(torch.float32).eps
    for step, row in zip(range(1, 21), reported):
        assert len(row) == 4
        for rank, norm in enumerate(row):
            ours = float.fromhex(ranks[rank]["ours"][step])
            assert abs(norm - ours) <= 4 * eps * ours, (
                f"step {step} rank {rank}: reported {norm!r}, computed {ours!r}"
            )
    logged = [
        r["param_norm"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["type"] == "step"
    ]
    assert logged == [row[0] for row in reported]
    # The torchrun capstone is the same run bit for bit, so its report.json holds these same norms.
    _, capstone_dir = capstone
    steps = json.loads((capstone_dir / "report.json").read_text())["steps"]
    assert [s["param_norms"] for s in steps] == reported, (
        "the torchrun capstone's norms differ from the forked run's"
    )


def _capstone_numel() -> int:
    """P, counted by the test: MiniGPT built from the capstone's composed config."""
    cfg = RunConfig.from_dict(compose_tree([]))
    return sum(p.numel() for p in build_model(cfg.model, seed=cfg.seed).parameters())


def _expected_optimizer_bytes(run_dir) -> int:
    """12P/N for the capstone (fp32 master + exp_avg + exp_avg_sq, 4 bytes each), P counted here and
    checked against the manifest's layout; N = 4 divides P, so there is no padding to allow for."""
    p, n = _capstone_numel(), 4
    layout = json.loads((run_dir / "checkpoints/step_00000010/manifest.json").read_text())["layout"]
    assert p == layout["numel"] == sum(e["numel"] for e in layout["params"]) and layout["padding"] == 0
    assert p % n == 0
    expected = 12 * p // n
    assert expected == 90_432  # P = 30,144: the number README's memory table shows
    return expected


def test_invariant_3_optimizer_bytes_are_12P_over_N(capstone):
    proc, run_dir = capstone
    expected = _expected_optimizer_bytes(run_dir)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["numel"] == _capstone_numel()
    assert [row["rank"] for row in report["memory"]] == [0, 1, 2, 3]
    for row in report["memory"]:
        assert row["measured"]["optimizer"] == expected, row
    # the printed memory table: rank, params B, formula, grads B, formula, optim B, formula, match
    rows = [line.split() for line in proc.stdout.splitlines() if line.rstrip().endswith((" yes", " NO"))]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    assert all(int(r[5]) == expected for r in rows), rows


def test_invariant_3_from_the_saved_optimizer_state_not_the_programs_measurement(capstone):
    """Independent of the program's own accounting: each rank's checkpoint holds its whole optimizer
    state (fp32 master, exp_avg, exp_avg_sq); read from the safetensors headers, it is 12P/N bytes."""
    _, run_dir = capstone
    expected = _expected_optimizer_bytes(run_dir)
    ckpt = run_dir / "checkpoints/step_00000010"
    for rank in range(4):
        raw = (ckpt / f"rank{rank:05d}.safetensors").read_bytes()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        state = {k: v for k, v in header.items() if k in ("master", "exp_avg", "exp_avg_sq")}
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "master"] and all(
            v["dtype"] == "F32" for v in state.values()
        )
        for v in state.values():  # the bytes stored are what the shape says
            start, end = v["data_offsets"]
            assert end - start == 4 * torch.Size(v["shape"]).numel(), (rank, v)
        nbytes = sum(4 * torch.Size(v["shape"]).numel() for v in state.values())
        assert nbytes == expected, (rank, nbytes)


def _resumed_rank(comm, tree: dict, run_dir: str) -> dict:
    """A rank of ``tree`` (trainrun.train) whose process RNGs start from another seed, as the program's
    own resume check reseeds them: a restore that left them alone would show in what they save."""
    seed = trainer_module.seed_process_rngs
    trainer_module.seed_process_rngs = lambda s, rank: seed(s + 1, rank)  # (in this forked rank only)
    return train(comm, tree, run_dir)


def test_invariant_4_checkpoint_manifest_matches_files_and_reload_is_identical(capstone, tmp_path):
    proc, run_dir = capstone
    ckpt = run_dir / "checkpoints/step_00000010"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["step"] == 10 and manifest["zero_stage"] == 1
    assert sorted(f["path"] for f in manifest["files"]) == [f"rank{r:05d}.safetensors" for r in range(4)]
    for entry in manifest["files"]:
        data = (ckpt / entry["path"]).read_bytes()
        assert len(data) == entry["bytes"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
    assert not list((run_dir / "checkpoints").glob(".*partial")), "no uncommitted leftovers"
    # The reload restores every byte: the same config resumed from the step-10 checkpoint (4 forked
    # ranks, RNGs seeded differently, then loaded) runs steps 11-20 with the capstone's losses, bit
    # for bit, and writes the capstone's step-20 checkpoint (optimizer state, RNGs), byte for byte.
    tree = compose_tree([f"checkpoint.resume={ckpt}"])
    resumed = run_ranks(_resumed_rank, 4, tree, str(tmp_path / "resumed"))
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = {r["step"]: r["loss_hex"] for r in logged if r["type"] == "step" and r["step"] > 10}
    assert sorted(want) == list(range(11, 21))
    for rank, result in enumerate(resumed):
        assert result["losses"] == want, f"rank {rank}: the losses after the reload differ"
    step20 = "checkpoints/step_00000020"
    assert_same_files(tmp_path / "resumed" / step20, run_dir / step20)
