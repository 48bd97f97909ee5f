"""The GPU kinds the planner prices a step for without one (distlib/app/plan/devices.py):
scripts/plan.py plan.device=..., and dist.layout=auto on a GPU run (which GPU: nvidia-smi, faked
here on PATH). The figures are NVIDIA's data sheets; what they predict is not checked on a GPU
here (docs/parallelism.md says so)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from e2e import ROOT

from distlib.app.observe.throughput import KNOWN_PEAKS
from distlib.app.plan import devices
from distlib.app.plan.devices import KINDS, LATENCY_S, NETWORK, Link
from distlib.launch import auto_layout
from distlib.launch.hydra_config import compose_tree

SPEC = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "plan.py")
plan_script = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(plan_script)


def run(capsys, *argv: str):
    try:
        status = plan_script.main(list(argv))
    except SystemExit as exc:
        status = exc.code
    out = capsys.readouterr()
    return status, out.out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_peaks_where_the_mfu_table_does(kind):
    """One data sheet in the project: the planner's peaks are the MFU table's for the same GPU."""
    name = KINDS[kind].name
    peaks = next(p for fragment, p in KNOWN_PEAKS if fragment in name)
    assert KINDS[kind].flops == peaks


def test_a_collective_is_a_latency_and_the_bytes_a_ring_moves_over_the_link():
    link, b = Link(nvlink=450e9), 8 * 2**20
    assert link.collective_s("all_reduce", b, 8) == pytest.approx(LATENCY_S + 2 * 7 / 8 * b / 450e9)
    assert link.collective_s("reduce_scatter", b, 4) == pytest.approx(LATENCY_S + 3 / 4 * b / 450e9)
    assert link.collective_s("send", b, 2) == pytest.approx(LATENCY_S + b / 450e9)
    assert link.collective_s("all_gather", b, 16) == pytest.approx(LATENCY_S + 15 / 16 * b / NETWORK)
    assert link.collective_s("handoff", 0, 4) == 0.0


def test_plan_device_prices_on_the_data_sheet_and_budgets_the_gpus_memory(capsys):
    words = ["model=llama_small", "dist.world_size=8", "train.dtype=bf16", "--layout", "--json"]
    status, out = run(capsys, *words, "plan.device=h100")
    doc = json.loads(out)
    assert status == 0 and doc["device"] == "H100 SXM 80GB" and doc["fits"]
    _, cpu_out = run(capsys, *words)
    gpu, cpu = doc["time"], json.loads(cpu_out)["time"]
    assert 0 < gpu["step_ms"] < cpu["step_ms"] and gpu["compute_ms"] < cpu["compute_ms"]
    status, out = run(capsys, "model=llama_small", "dist.world_size=8", "plan.device=a100", "--layout")
    assert "fits plan.budget_gb=80: " in out and "predicted step on A100 SXM 80GB: " in out


@pytest.mark.parametrize(
    "argv, said",
    [
        (["plan.device=tpu"], "error: plan.device must be one of cpu, a100, h100, h200, got 'tpu'"),
        (
            ["plan.device=h100", "--verify", "1"],
            "error: --verify trains on this machine, not on plan.device=h100",
        ),
    ],
)
def test_a_device_the_planner_cannot_price_or_verify_is_one_line(capsys, argv, said):
    assert run(capsys, *argv)[0] == said


@pytest.mark.parametrize(
    "name, kind",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("Tesla V100-SXM2-32GB", None),
    ],
)
def test_a_gpu_is_known_by_its_name(name, kind):
    assert devices.kind_named(name) == kind


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """An nvidia-smi first on PATH that prints what the test says (or fails)."""

    def install(text: str, status: int = 0) -> None:
        smi = tmp_path / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\nprintf '{text}'\nexit {status}\n")
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    return install


def test_a_gpu_runs_steps_are_priced_on_its_kind_and_budgeted_its_memory(fake_smi):
    tree = compose_tree(["train.device=auto", "dist.backend=nccl", "train.dtype=bf16"])
    fake_smi("NVIDIA H200\\nNVIDIA H200\\n")
    machine, memory, why = auto_layout.pricing(tree)
    assert (machine.name, machine.flops, memory, why) == ("H200 SXM 141GB", 989e12, 141.0, "")
    fake_smi("Tesla V100-SXM2-32GB\\n")
    assert auto_layout.pricing(tree) == (
        None,
        None,
        "step time not predicted for this GPU: nvidia-smi names none of a100, h100, h200",
    )
    fake_smi("", status=9)  # no driver
    assert auto_layout.pricing(tree)[0] is None
    cpu_run = compose_tree(["dist.backend=nccl", "train.device=cpu"])
    assert auto_layout.pricing(cpu_run)[0].link is None  # a CPU run: this machine, measured
