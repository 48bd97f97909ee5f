"""scripts/resume.sh: exact resume from the step-10 checkpoint, and its mismatch report."""

import json
import shutil

import pytest
from ckpt_util import assert_same_files
from forkrun import run_script

pytestmark = pytest.mark.slow


def test_resume_script_proves_bitwise_resume(resume_script_run, tmp_path):
    # README's `bash scripts/resume.sh`, run once for this test and tests/test_readme_commands.py
    proc, out = resume_script_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "RESUME EXACT: steps 11-20 bitwise equal" in proc.stdout
    assert "step-20 checkpoints are byte-identical" in proc.stdout  # what it says; the bytes:
    assert proc.stdout.splitlines()[-1] == (
        f"the two runs are kept in {out} (full/, resumed/ and their logs); remove them with: rm -r {out}"
    )
    full20, resumed20 = (out / run / "checkpoints/step_00000020" for run in ("full", "resumed"))
    shards = [f"rank{r:05d}.safetensors" for r in range(4)]
    assert sorted(p.name for p in full20.iterdir()) == ["manifest.json", *shards]
    assert_same_files(full20, resumed20)
    full = [json.loads(x) for x in (out / "full/metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(x) for x in (out / "resumed/metrics.jsonl").read_text().splitlines()]
    full, resumed = ([r for r in records if r["type"] == "step"] for records in (full, resumed))  # not events
    assert [r["step"] for r in resumed] == list(range(11, 21))
    assert [r["loss_hex"] for r in resumed] == [r["loss_hex"] for r in full[10:]]

    # The comparison must catch a difference: doctor step 14 of the resumed run.
    doctored = tmp_path / "doctored"
    shutil.copytree(out / "resumed", doctored)
    records = [json.loads(x) for x in (doctored / "metrics.jsonl").read_text().splitlines()]
    (step14,) = [r for r in records if r["type"] == "step" and r["step"] == 14]
    step14["loss_hex"] = (float.fromhex(step14["loss_hex"]) * (1 + 2**-40)).hex()
    (doctored / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    bad = run_script("scripts/compare_runs.py", str(out / "full"), str(doctored), "--from-step", "11")
    assert bad.returncode == 1
    assert "losses first differ at step 14" in bad.stderr
