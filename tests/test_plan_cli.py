"""scripts/plan.py as a user meets it: the ranked layouts (JSON and table), one layout's verdict
against a budget, and one line (no traceback) for each kind of bad input. Run in process (the
documented command itself runs in docs/parallelism.md's block, tests/test_doc_commands.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from distlib.app.config.run import RunConfig
from distlib.app.plan import activations, report, step_peak
from distlib.app.plan.activations import rank_activations
from distlib.app.plan.states import model_states
from distlib.launch import plan_verify
from distlib.launch.hydra_config import compose_tree

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "plan.py")
plan_script = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(plan_script)


def run(capsys, *argv: str) -> tuple[int | str, str, str]:
    """(exit status or SystemExit message, stdout, stderr) of the script's main."""
    try:
        status = plan_script.main(list(argv))
    except SystemExit as exc:
        status = exc.code
    out = capsys.readouterr()
    return status, out.out, out.err


def test_every_listed_layout_is_accepted_and_predicted_as_listed(capsys):
    words = ("model=deepseek_v3_tiny", "dist.world_size=4")
    status, out, _ = run(capsys, *words, "plan.budget_gb=0.004", "--json")
    assert status == 0
    report = json.loads(out)
    layouts = report["layouts"]
    # every layout's activations, its pipeline stages' too (unlike blocks: a dense one first)
    assert all(r["activations"] is not None for p in layouts for r in p["ranks"])
    assert any("dist.pp=2" in p["overrides"] for p in layouts)
    assert [p["peak_bytes"] for p in layouts] == sorted(p["peak_bytes"] for p in layouts)
    assert len(layouts) > 50 and report["refused"] > 0
    searched = {o.split("=")[0] for p in layouts for o in p["overrides"]}
    assert {"dist.tp", "dist.pp", "dist.cp", "dist.ep", "zero.stage", "zero.overlap"} <= searched
    assert {"dist.sp", "train.grad_accum", "model.activation_checkpointing"} <= searched
    for p in layouts[:: len(layouts) // 40]:  # 40 spread over them, each composed as a user would type it
        cfg = RunConfig.from_dict(compose_tree([*words, *p["overrides"]]))
        # (step peaks only when chosen)
        kept = rank_activations(cfg)
        ranks = [
            {**r.as_dict(), "activations": a, "step_peak": None} for r, a in zip(model_states(cfg), kept)
        ]
        assert p["ranks"] == ranks
        assert p["peak_bytes"] == max(
            r["params"] + r["grads"] + r["optimizer"] + (r["activations"] or 0) for r in ranks
        )
        assert p["fits"] == (p["peak_bytes"] <= 0.004e9)
    assert any(p["fits"] for p in layouts) and not all(p["fits"] for p in layouts)


def test_layouts_whose_activations_are_not_predicted_are_listed_after_the_known(capsys, monkeypatch):
    # as document masks make every context-parallel layout (whose data needs a tokenizer here)
    monkeypatch.setattr(activations, "predicted", lambda cfg: cfg.dist.cp == 1)
    status, out, _ = run(capsys, "model=llama", "dist.world_size=4", "plan.budget_gb=1", "--json")
    assert status == 0
    layouts = json.loads(out)["layouts"]
    known = [all(r["activations"] is not None for r in p["ranks"]) for p in layouts]
    assert known == sorted(known, reverse=True) and 0 < sum(known) < len(known)  # the whole known first
    assert known == ["dist.cp=2" not in p["overrides"] and "dist.cp=4" not in p["overrides"] for p in layouts]
    for part in (True, False):  # each part smallest first
        peaks = [p["peak_bytes"] for p, k in zip(layouts, known) if k == part]
        assert peaks == sorted(peaks)


def test_the_table_names_the_smallest_and_the_fastest_layout_that_fit(capsys):
    status, out, _ = run(capsys, "model=llama", "dist.world_size=4", "zero=stage3", "plan.budget_gb=1")
    assert status == 0
    lines = out.splitlines()
    rows = [line for line in lines if line.rstrip().endswith(("yes", "NO")) or "  yes  " in line]
    assert rows and all("zero.stage" not in line for line in rows)  # zero=stage3 was pinned
    assert lines[-2].startswith("smallest that fits: ")
    first = rows[0].split("yes", 1)[1].split()
    smallest, peak = lines[-2].removeprefix("smallest that fits: ").split(", ")
    assert smallest.split() == first and peak == _step_peak_said("model=llama", "zero=stage3", *first)
    # the fastest: the row whose predicted step (the column before "fits") is the least
    ms = {tuple(row.split("yes", 1)[1].split()): float(row.split("yes", 1)[0].split()[-1]) for row in rows}
    said, chosen = lines[-1].split(": ", 1)
    chosen, peak = chosen.split(", ")
    quickest = min(ms.values())
    assert said == f"fastest that fits (predicted {quickest:.1f} ms a step)"
    assert ms[tuple(chosen.split())] == quickest and len(set(ms.values())) > 1
    assert peak == _step_peak_said("model=llama", "zero=stage3", *chosen.split())


def test_the_fastest_line_says_so_when_none_it_tried_fits_in_its_step(capsys, monkeypatch):
    words = ("model=llama", "dist.world_size=4", "zero=stage3")
    _, out, _ = run(capsys, *words, "plan.budget_gb=1")
    fastest = out.splitlines()[-1].split(": ", 1)[1].split(", ")[0].split()
    smallest = out.splitlines()[-2].split(": ", 1)[1].split(", ")[0].split()
    assert fastest != smallest
    # a budget the fastest's model states and activations fit but its step does not, while the
    # smallest's step does; and one layout tried each way
    monkeypatch.setattr(report, "CONFIRM_AT_MOST", 1)
    (fast_kept, fast_step), (_, small_step) = (_peaks(*words, *layout) for layout in (fastest, smallest))
    assert max(fast_kept, small_step) < fast_step
    budget = (max(fast_kept, small_step) + fast_step) / 2 / 1e9
    status, out, err = run(capsys, *words, f"plan.budget_gb={budget!r}")
    assert status == 0, err
    assert out.splitlines()[-1] == (
        "fastest that fits: none of the 1 fastest whose model states and activations fit fits in its "
        "step; the smallest that fits is the one to run"
    )
    assert out.splitlines()[-2].startswith(f"smallest that fits: {' '.join(smallest)}, ")


def test_the_fastest_line_says_so_when_no_step_time_is_predicted(capsys, monkeypatch):
    # as document masks over context-parallel ranks leave a layout (whose data needs a tokenizer
    # here), every layout
    monkeypatch.setattr(report, "predicted_time", lambda cfg, machine: None)
    words = ("model=llama", "dist.world_size=2")
    status, out, err = run(capsys, *words, "plan.budget_gb=1")
    assert status == 0, err
    rows = [line for line in out.splitlines() if "  yes  " in line]
    assert rows and all(" ? " in row for row in rows)  # no row has a step time
    assert out.splitlines()[-1] == (
        "fastest that fits: not predicted (no layout that fits has a predicted step time)"
    )


def _peaks(*words: str) -> tuple[int, int]:
    """(model states and activations kept, step peak) of one layout's fullest rank, in bytes."""
    cfg = RunConfig.from_dict(compose_tree(["dist.world_size=4", *words]))
    step_peak.stage_step_peak.cache_clear()
    kept = max(r.params + r.grads + r.optimizer + a for r, a in zip(model_states(cfg), rank_activations(cfg)))
    return kept, max(step_peak.rank_step_peaks(cfg))


def _step_peak_said(*words: str) -> str:
    """How the planner says a layout's step peak: its fullest rank's, from the dry steps run here."""
    cfg = RunConfig.from_dict(compose_tree(["dist.world_size=4", *words]))
    step_peak.stage_step_peak.cache_clear()
    return f"its step peaking at {max(step_peak.rank_step_peaks(cfg)) / 1e9:.6g} GB"


def test_one_layout_gives_every_rank_and_a_verdict(capsys):
    status, out, _ = run(capsys, "dist.world_size=4", "zero=stage2", "--layout", "plan.budget_gb=0.0002")
    cfg = RunConfig.from_dict(compose_tree(["dist.world_size=4", "zero=stage2"]))
    rows = [line.split() for line in out.splitlines()[1:5]]
    step_peak.stage_step_peak.cache_clear()
    want = [
        [r.rank, r.params, r.grads, r.optimizer, kept, r.params + r.grads + r.optimizer + kept, peak]
        for r, kept, peak in zip(model_states(cfg), rank_activations(cfg), step_peak.rank_step_peaks(cfg))
    ]
    assert rows == [[str(x) for x in row] for row in want]
    fullest = max(row[-1] for row in want)
    assert (
        status == 1
        and f"NOT fit plan.budget_gb=0.0002: the fullest rank's step peaks at {fullest / 1e9:.6g} GB" in out
        and "of model states and activations" in out
    )


@pytest.mark.parametrize(
    "argv, says",
    [
        (["dist.world_size=0"], "dist.world_size must be an integer >= 1, got 0"),
        (["dist.world_size=4", "dist.tp=3"], "dist.tp=3 must be >= 1 and divide dist.world_size=4"),
        (["plan.budget_gb=lots"], "plan.budget_gb must be a positive number of GB per rank, got 'lots'"),
        (["plan.budget_gb=0"], "plan.budget_gb must be a positive number"),
        (["plan.budget=1"], "unknown planner key plan.budget"),
        (["modle=llama"], "error: "),
        (["model=lama"], "model=lama: conf/model/ has no lama.yaml; model is one of deepseek_v3, "),
        (
            ["dist.world_size=3", "model.n_heads=4", "dist.tp=3", "--layout"],
            "dist.tp=3 must divide model.n_heads=4",
        ),
    ],
)
def test_bad_input_is_one_line(capsys, argv, says):
    status, out, err = run(capsys, *argv)
    assert isinstance(status, str) and status.startswith("error: ") and says in status
    assert "\n" not in status and "Traceback" not in out + err


def test_a_budget_the_states_fit_but_no_step_is_one_line(capsys):
    words = ["model=llama", "dist.world_size=2"]
    layouts = plan_script.plan(compose_tree(words), set())[0]
    smallest = layouts[0]
    budget = f"{smallest.peak / 1e9:.9g}"  # the smallest's states and activations fit exactly
    tried = min(sum(p.peak <= smallest.peak for p in layouts), 20)  # (and those as small)
    status, out, err = run(capsys, *words, f"plan.budget_gb={budget}")
    step_peak.stage_step_peak.cache_clear()
    peak = max(step_peak.rank_step_peaks(smallest.cfg))
    assert status == 1 and peak > smallest.peak  # its step holds more than its states and activations
    assert err.splitlines() == [
        f"error: no layout fits plan.budget_gb={budget} in its step: the {tried} smallest by model "
        f"states and activations peak above it (the first: its step peaking at {peak / 1e9:.6g} GB); "
        "raise plan.budget_gb or dist.world_size"
    ]


def test_a_budget_nothing_fits_names_the_smallest(capsys):
    status, out, err = run(capsys, "model=llama", "dist.world_size=2", "plan.budget_gb=0.00001")
    assert status == 1
    line = err.strip()
    assert "\n" not in line and line.startswith("error: no layout fits plan.budget_gb=1e-05")
    assert "raise plan.budget_gb or dist.world_size" in line


def test_verify_runs_the_smallest_and_a_sample_and_finds_them_as_planned(capsys):
    status, out, _ = run(capsys, "dist.world_size=2", "zero=stage2", "--verify", "1")
    lines = out.splitlines()
    head = (
        f"verified on this machine (train.py, {plan_verify.STEPS} steps each; step ms and the fullest "
        "rank's step peak in bytes: measured / predicted):"
    )
    start = lines.index(head)
    verdicts = lines[start + 1 : -1]
    table_rows = [line for line in lines[:start] if "  yes  " in line or line.rstrip().endswith("yes")]
    smallest = table_rows[0].split("yes", 1)[1].strip() or "(as given)"
    assert len(verdicts) == 2 and " ".join(verdicts[0].split()[8:]) == smallest
    for verdict in verdicts:  # "as planned", the step ms and step peaks measured / predicted, the layout
        measured, slash, predicted, peak, slash_too, planned_peak = verdict.split()[2:8]
        assert slash == slash_too == "/" and float(measured) > 0 and float(predicted) > 0
        words = ["dist.world_size=2", "zero=stage2", *verdict.split()[8:]]
        step_peak.stage_step_peak.cache_clear()
        cfg = RunConfig.from_dict(compose_tree(words))
        assert int(peak) == int(planned_peak) == max(step_peak.rank_step_peaks(cfg))
    assert (
        all(v.startswith("  as planned  ") for v in verdicts)
        and lines[-1] == "2 of 2 layouts measured as planned"  # (no rank correlation of 2 layouts)
    )
    assert status == 0


def test_a_layout_measured_otherwise_is_named_with_its_rank_and_category():
    cfg = RunConfig.from_dict(compose_tree(["dist.world_size=2", "zero=stage2"]))
    layout = plan_script.planned(cfg, ["zero=stage2"])
    layout = plan_script.with_step_peaks(layout)
    truth = [
        {**r.as_dict(), "activations": a, "step_peak": s}
        for r, a, s in zip(layout.ranks, layout.activations, layout.step_peaks)
    ]
    assert plan_verify.misses(layout, truth) == []
    off = [dict(row) for row in truth]
    off[1]["grads"] += 4
    off[0]["activations"] -= 8
    off[1]["step_peak"] += 1
    assert plan_verify.misses(layout, off) == [
        f"rank 0 activations: measured {truth[0]['activations'] - 8}, planned {truth[0]['activations']}",
        f"rank 1 grads: measured {truth[1]['grads'] + 4}, planned {truth[1]['grads']}",
        f"rank 1 step peak: measured {truth[1]['step_peak'] + 1}, planned {truth[1]['step_peak']}",
    ]


def test_a_layout_train_py_refuses_is_its_one_line(tmp_path):
    said = plan_verify._measure(["dist.world_size=2", "dist.tp=3"], tmp_path / "run")
    assert said.startswith("train.py exited 2: ") and "dist.tp=3" in said and "\n" not in said


def test_verify_needs_a_count(capsys):
    status, _, _ = run(capsys, "--verify", "some")
    assert status == "error: --verify takes how many layouts to run (a whole number >= 1), got 'some'"


def test_json_with_verify_is_one_document_with_every_ranks_measurement(capsys):
    status, out, _ = run(capsys, "dist.world_size=2", "zero=stage3", "--layout", "--json", "--verify", "1")
    doc = json.loads(out)  # one document: the plan, and what was measured
    (verified,) = doc["verified"]
    assert status == 0 and doc["fits"] and verified["misses"] == []
    for planned, measured in zip(doc["ranks"], verified["ranks"], strict=True):
        assert {k: planned[k] for k in ("params", "grads", "optimizer", "activations")} == {
            k: measured[k] for k in ("params", "grads", "optimizer", "activations")
        }


def test_configs_transformers_made_plan_where_only_some_layouts_fit_their_batch(capsys, tmp_path):
    """A Llama config.json (6 heads, 3 blocks) over 6 ranks: the 16 sequences of a step divide over
    1 or 2 data-parallel ranks only, so the plan keeps just those layouts (the command line's own,
    6 data-parallel ranks, is refused). A Mixtral config keeps transformers' 131,072-token context:
    one line, no traceback; at 32 tokens it plans."""
    from family_models import quiet_transformers

    transformers = quiet_transformers()
    llama = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    llama.save_pretrained(tmp_path / "llama")
    base = [f"model.init_from={tmp_path / 'llama'}", "dist.world_size=6"]
    status, out, _ = run(capsys, *base, "--json")
    layouts = json.loads(out)["layouts"]
    assert status == 0 and layouts
    for p in layouts[::5]:
        cfg = RunConfig.from_dict(compose_tree([*base, *p["overrides"]]))
        assert cfg.dp_size in (1, 2) and cfg.model.n_heads == 6 and cfg.model.n_layers == 3
    transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=3,
        num_experts_per_tok=2,
    ).save_pretrained(tmp_path / "mixtral")
    mixtral = [f"model.init_from={tmp_path / 'mixtral'}", "dist.world_size=2"]
    status, _, _ = run(capsys, *mixtral)
    assert (
        isinstance(status, str) and status.startswith("error: no layout is accepted: ") and "\n" not in status
    )
    status, out, _ = run(capsys, *mixtral, "model.seq_len=32")
    assert status == 0 and "smallest that fits: " in out


def test_a_reader_that_stops_early_gets_no_traceback():
    """``scripts/plan.py ... | head -3``: the table's reader leaves; the planner stops quietly."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "plan.py"), "model=llama", "dist.world_size=4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    proc.stdout.close()  # as head does after its lines: here before any, so the first write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) != 0 and "Traceback" not in err and err == "", err
