"""The capstone run, end to end under torchrun, with its four invariants checked
independently of the program's own checks (from report.json, metrics.jsonl and the files)."""
import hashlib
import json

import pytest

from e2e import train

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
    losses = [r["loss"] for r in records if r["type"] == "step"]      # (events are logged too)
    assert len(losses) == 20
    assert all(b <= a * (1 + 1e-6) for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0]


def test_invariant_2_every_rank_has_the_same_parameter_norm(capstone):
    _, run_dir = capstone
    steps = json.loads((run_dir / "report.json").read_text())["steps"]
    assert len(steps) == 20
    for s in steps:
        assert len(s["param_norms"]) == 4 and len(set(s["param_norms"])) == 1, s


def test_invariant_3_optimizer_bytes_are_12P_over_N(capstone):
    _, run_dir = capstone
    report = json.loads((run_dir / "report.json").read_text())
    p = report["numel"]
    manifest = json.loads((run_dir / "checkpoints/step_00000010/manifest.json").read_text())
    assert p == manifest["layout"]["numel"] == sum(e["numel"] for e in manifest["layout"]["params"])
    for row in report["memory"]:
        optimizer = row["measured"]["optimizer"]
        assert 0 <= optimizer - 12 * p / 4 < 12, row     # at most N-1 padding elements


def test_invariant_3_from_the_saved_optimizer_state_not_the_programs_measurement(capstone):
    """Independent of the program's own accounting: each rank's checkpoint holds its whole optimizer
    state (fp32 master, exp_avg, exp_avg_sq); read from the safetensors headers, it is 12P/N bytes."""
    _, run_dir = capstone
    ckpt = run_dir / "checkpoints/step_00000010"
    p = json.loads((ckpt / "manifest.json").read_text())["layout"]["numel"]
    for rank in range(4):
        raw = (ckpt / f"rank{rank:05d}.safetensors").read_bytes()
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        state = {k: v for k, v in header.items() if k in ("master", "exp_avg", "exp_avg_sq")}
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "master"] and all(v["dtype"] == "F32" for v in state.values())
        nbytes = sum(end - start for v in state.values() for start, end in [v["data_offsets"]])
        assert 0 <= nbytes - 12 * p / 4 < 12 * 4, (rank, nbytes)   # padding: fewer than N elements each


def test_invariant_4_checkpoint_manifest_matches_files_and_reload_is_identical(capstone):
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
    report = json.loads((run_dir / "report.json").read_text())
    assert report["resume_check"] == {"step": 10, "mismatches": []}


def test_a_broken_invariant_is_named_and_fails_the_run(tmp_path):
    # lr=1.0 makes the loss jump around: invariant 1 must be reported and the exit code non-zero.
    # (With the divergence guard on, the run would roll back instead: tests/test_unattended*.py.)
    proc = train(tmp_path, "optimizer.lr=1.0", "dist.world_size=2", "guard.enabled=false")
    assert proc.returncode != 0
    assert "INVARIANT FAILED: invariant 1 (monotone loss)" in proc.stderr
    assert "RESUME VERIFIED" in proc.stdout  # the other invariants still hold and are still checked
