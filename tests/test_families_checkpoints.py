"""GPT-2, Llama and Qwen3 checkpoints: the manifest names the family; a resume is bitwise at the same layout
and within 1e-5 at another world size, ZeRO stage or pipeline degree (resharded on load, or by
scripts/ckpt.py reshard); a checkpoint of any layout reassembles into the whole model
(distlib/checkpoint/relayout.py: every rank's parameters are shard_of its slice of it, bit for bit);
sampling builds the right family; scripts/export_hf.py writes a directory transformers loads, whose
logits and greedy tokens are ours; model.init_from starts a run from a transformers directory (step
1's loss is transformers' loss on that batch) in several layouts, and a resume ignores it.

Three run_ranks calls carry every training run: the first runs (world size 2), their resumes at the
same layout (2), and resumes at world size 1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_util import assert_same_files, assert_saved_final_state, state_of
from family_models import (
    max_diff,
    perturb_,
    quiet_transformers,
    tokens,
)
from forkrun import run_script
from multiproc import run_ranks
from trainrun import compose_tree

import train
from distlib.app.checkpointing import hf_export, init_from, sampling
from distlib.app.checkpointing.manifest_config import manifest_config
from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.data.batches import BatchPlan, GlobalBatches, make_corpus, split_heldout
from distlib.app.model import gpt2, llama
from distlib.app.model.minigpt import MiniGPT
from distlib.app.trainer import Trainer
from distlib.checkpoint import offline, relayout
from distlib.checkpoint import sharded as checkpoint
from distlib.launch.torchrun import use_deterministic_kernels
from distlib.parallel.tensor_parallel import Split, shard_of

pytestmark = pytest.mark.slow
transformers = quiet_transformers()

REL = 1e-5
FIXTURE = Path(__file__).with_name("fixtures") / "ckpt_v1_ws2_stage1_step10"  # MiniGPT, no model.family
GPT2 = ["model=gpt2", "model.tie_embeddings=true"]
LLAMA = ["model=llama", "model.n_kv_heads=2", "model.mlp_hidden=48", "model.norm_eps=1e-6"]
QWEN3 = ["model=qwen3", "model.mlp_hidden=48"]  # 4 query / 2 key-value heads of 16 (dim 32)
PP2 = ["dist.pp=2", "train.grad_accum=2"]
SAVES = ["checkpoint.verify_resume=true", "metrics.progress_every=0"]
# name -> (model, layout, steps, checkpoint.every_steps); "init" runs start from a transformers directory
FIRST = {
    "gpt2": (GPT2, ["zero=stage3"], 6, 3),
    "llama": (LLAMA, PP2, 6, 3),
    "init_gpt2_zero1": (GPT2, ["zero=stage1"], 2, 1),
    "init_gpt2_tp2": (GPT2, ["dist.tp=2"], 2, 1),
    "init_llama_pp2": (LLAMA, PP2, 2, 1),
    "init_llama_zero3": (LLAMA, ["zero=stage3"], 2, 1),
    "qwen3": (QWEN3, ["dist.tp=2"], 6, 3),  # the head norms' gradients summed over the tp ranks
    "init_qwen3_pp2": (QWEN3, PP2, 2, 1),
}


def _hf_dirs(root: Path) -> dict[str, Path]:
    """A transformers GPT-2 (tied), Llama and Qwen3 (grouped-query) of the runs' shapes, weights
    perturbed."""
    configs = {
        "gpt2": transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=None,
        ),
        "llama": transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False,
        ),
        "qwen3": transformers.Qwen3Config(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=16, tie_word_embeddings=False,
        ),
    }  # fmt: skip
    out = {}
    for seed, (family, config) in enumerate(configs.items()):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(config)
        perturb_(model, seed)
        out[family] = root / f"hf_{family}"
        model.save_pretrained(out[family])
    return out


def _tree(name: str, world: int, run_dir: Path, hf: dict, resume: str | None = None) -> dict:
    model, layout, steps, every = FIRST[name]
    extra = [f"model.init_from={hf[name.split('_')[1]]}"] if name.startswith("init") else []
    extra += [f"checkpoint.resume={resume}"] if resume else []
    if world == 1:
        layout = [o for o in layout if o.startswith("zero=") is False and not o.startswith("dist.")]
    return compose_tree(
        model + layout + SAVES + extra + [f"dist.world_size={world}", f"train.steps={steps}"]
        + [f"checkpoint.every_steps={every}", f"hydra.run.dir={run_dir}"]
    )  # fmt: skip


def _train(comm, runs: list[tuple[dict, str]]) -> list[dict]:
    use_deterministic_kernels()  # the product's switch: the same ATen flag, without torch._inductor
    out = []
    for tree, run_dir in runs:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            trainer = Trainer(RunConfig.from_dict(tree), comm, Path(run_dir))
            result = trainer.run()
        opt = trainer.optimizer
        (group,) = opt.groups.values()  # a dense model: one parameter group
        flat = opt.full_params()  # this rank's pieces (collective at ZeRO-3)
        out.append(
            {
                "losses": {s.step: s.loss.hex() for s in result.steps},
                "state": state_of(opt),  # this rank's optimizer partition at the end
                # numpy, not tensors: torch pickles tensors through shared memory that dies with the rank
                "params": {
                    s.name: flat[s.offset : s.offset + s.numel].view(s.shape).numpy().copy()
                    for s in group.layout.slots
                },
                "splits": {n: s.to_dict() for n, s in trainer.checkpointer.contents.tp_splits.items()},
            }
        )  # fmt: skip
    return out


def _ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / checkpoint.step_dir_name(step)


def _losses(run: dict) -> dict[int, float]:
    return {k: float.fromhex(v) for k, v in run["losses"].items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The first runs, their resumes, and the paths: {"first": {name: [rank results]}, ...}."""
    root = tmp_path_factory.mktemp("families")
    hf = _hf_dirs(root)
    dirs = {name: root / name for name in FIRST}
    first = run_ranks(_train, 2, [(_tree(n, 2, dirs[n], hf), str(dirs[n])) for n in FIRST], timeout_s=600)
    # the same layouts resume from the middle checkpoint (the last one set aside) ...
    for name in ("gpt2", "llama", "init_llama_zero3"):
        last = FIRST[name][2]
        os.rename(_ckpt(dirs[name], last), root / f"{name}_step{last}.aside")
    aside = root / "hf_llama.aside"
    os.rename(hf["llama"], aside)  # ... and a resume of an init_from run never reads the directory
    again = [("gpt2", "latest"), ("llama", "latest"), ("init_llama_zero3", "latest")]
    resumed = run_ranks(
        _train, 2, [(_tree(n, 2, dirs[n], hf, r), str(dirs[n])) for n, r in again], timeout_s=600
    )
    os.rename(aside, hf["llama"])
    # ... and another world size, ZeRO stage and pipeline degree resume from it (resharded on load), as
    # does scripts/ckpt.py reshard's copy of the GPT-2 checkpoint for one rank
    copy = root / "gpt2_step3_ws1"
    assert (
        run_script(
            "scripts/ckpt.py", "reshard", str(_ckpt(dirs["gpt2"], 3)), str(copy), "--world-size", "1"
        ).returncode
        == 0
    )
    ws1 = [("gpt2", _ckpt(dirs["gpt2"], 3)), ("llama", _ckpt(dirs["llama"], 3)), ("gpt2", copy)]
    ws1.append(("qwen3", _ckpt(dirs["qwen3"], 3)))
    other = [
        (_tree(n, 1, root / f"ws1_{i}", hf, str(c)), str(root / f"ws1_{i}")) for i, (n, c) in enumerate(ws1)
    ]
    moved = run_ranks(_train, 1, other, timeout_s=600)[0]
    return {
        "root": root, "hf": hf, "dirs": dirs,
        "first": {n: [rank[i] for rank in first] for i, n in enumerate(FIRST)},
        "resumed": {n: resumed[0][i] for i, (n, _) in enumerate(again)},
        "resumed_ranks": {n: [rank[i] for rank in resumed] for i, (n, _) in enumerate(again)},
        "moved": moved,
    }  # fmt: skip


def test_the_manifest_names_the_family_and_an_old_one_is_minigpt(trained):
    for name, family in (("gpt2", "gpt2"), ("llama", "llama"), ("init_gpt2_tp2", "gpt2")):
        manifest = checkpoint.read_manifest(_ckpt(trained["dirs"][name], 1 if name.startswith("init") else 3))
        assert manifest["model"]["family"] == family
    manifest = checkpoint.read_manifest(FIXTURE)
    assert "family" not in manifest["model"] and manifest_config(manifest, FIXTURE)[0].family == "minigpt"
    assert type(sampling.load_model(FIXTURE)) is MiniGPT


def test_a_resume_at_the_same_layout_is_bitwise(trained):
    for name in ("gpt2", "llama", "init_llama_zero3"):
        full, resumed = trained["first"][name][0], trained["resumed"][name]
        steps = FIRST[name][2]
        assert sorted(resumed["losses"]) == list(range(FIRST[name][3] + 1, steps + 1)), name
        assert resumed["losses"] == {k: full["losses"][k] for k in resumed["losses"]}, name
        # invariant 4, from the files: after the reload the run saves its last step byte for byte as
        # the uninterrupted run did (that one set aside), each shard holding its rank's final state
        again = _ckpt(trained["dirs"][name], steps)
        assert_same_files(again, trained["root"] / f"{name}_step{steps}.aside")
        assert_saved_final_state(again, trained["resumed_ranks"][name])


def test_another_world_size_stage_or_pipeline_degree_resumes_within_tolerance(trained):
    """World size 2 -> 1 (GPT-2 from ZeRO-3 to ZeRO-1; Llama from 2 pipeline stages to 1; Qwen3
    from 2 tensor-parallel ranks to 1), and the scripts/ckpt.py reshard copy for one rank: steps 4-6
    as the uninterrupted run's, and the copy resumes bit for bit as the on-load resharding does."""
    gpt2_run, llama_run, from_copy, qwen3_run = trained["moved"]
    for name, run in (("gpt2", gpt2_run), ("llama", llama_run), ("qwen3", qwen3_run)):
        want, got = _losses(trained["first"][name][0]), _losses(run)
        assert sorted(got) == [4, 5, 6]
        worst = max(abs(got[k] - want[k]) / want[k] for k in got)
        assert worst <= REL, f"{name}: {worst:.2e} from the uninterrupted run"
    assert from_copy["losses"] == gpt2_run["losses"]


def _check_reassembly(ckpt: Path, ranks: list[dict]) -> dict[str, torch.Tensor]:
    full = relayout.full_tensors(ckpt, checkpoint.verify(ckpt))
    for rank in ranks:
        for name, local in rank["params"].items():
            split = rank["splits"].get(name)
            assert torch.equal(
                shard_of(full[name], Split(**split) if split else None), torch.from_numpy(local)
            ), name
    return full


def test_every_layout_reassembles_into_the_whole_model(trained):
    """ZeRO-3 partitions, pipeline stages (Llama pp2) and tensor-parallel pieces (GPT-2 tp2): each
    rank's parameters at the end of the run are exactly its piece of the reassembled model."""
    d = trained["dirs"]
    cases = [("gpt2", _ckpt(d["gpt2"], 6)), ("init_gpt2_tp2", _ckpt(d["init_gpt2_tp2"], 2))]
    cases.append(("init_llama_pp2", _ckpt(d["init_llama_pp2"], 2)))
    for name, ckpt in cases:
        full = _check_reassembly(ckpt, trained["first"][name])
        assert list(full) == [n for n, _ in sampling.load_model(ckpt).named_parameters()]
    splits = trained["first"]["init_gpt2_tp2"][1]["splits"]
    assert splits and all(s["parts"] == 2 and s["index"] == 1 for s in splits.values())  # really split


def test_sampling_builds_the_family_the_checkpoint_holds(trained, tmp_path):
    d = trained["dirs"]
    g = sampling.load_model(_ckpt(d["gpt2"], 6))
    assert type(g) is gpt2.GPT2 and g.lm_head.weight is g.tok_emb.weight
    lm = sampling.load_model(_ckpt(d["llama"], 6))
    assert type(lm) is llama.Llama and lm.cfg.n_kv_heads == 2
    (written,) = offline.consolidate(_ckpt(d["gpt2"], 6), tmp_path / "consolidated")  # ckpt.py consolidate
    again = sampling.load_model(written)
    assert type(again) is gpt2.GPT2 and again.lm_head.weight is again.tok_emb.weight
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), g.parameters()))


def _hf_loss(hf_dir: Path, tree: dict) -> float:
    """transformers' own loss (its ForCausalLMLoss, labels already shifted) of step 1's global batch."""
    cfg = RunConfig.from_dict(tree)
    d = cfg.data
    corpus = split_heldout(
        make_corpus(d.seed, d.total_tokens, cfg.model.vocab_size, d.follow_prob), d.val_fraction
    )
    batches = GlobalBatches(corpus[0], cfg.model.seq_len, BatchPlan(cfg.global_batch, 1, 1), cfg.seed)
    ((x, y),) = batches.step_batches(1, 0)
    y = y.contiguous()  # a view of the windows; transformers' loss .view()s it
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return float(model(input_ids=x, labels=y, shift_labels=y).loss)


def test_init_from_starts_at_transformers_loss_in_every_layout(trained):
    """Step 1 computes the loss of the directory's weights: ZeRO-1 on 2 data-parallel ranks, 2-way
    tensor parallel, 2 pipeline stages, ZeRO-3."""
    for name in FIRST:
        if not name.startswith("init"):
            continue
        family = name.split("_")[1]
        want = _hf_loss(trained["hf"][family], _tree(name, 2, trained["root"], trained["hf"]))
        got = _losses(trained["first"][name][0])[1]
        assert abs(got - want) <= 1e-5, f"{name}: step 1 loss {got}, transformers' {want}"
        assert _losses(trained["first"][name][0])[2] < got  # and it trains


def test_init_from_refuses_a_directory_that_does_not_fit(trained, capsys):
    hf = trained["hf"]
    tree = compose_tree(LLAMA + ["model.dim=48", "model.n_layers=3", f"model.init_from={hf['llama']}"])
    with pytest.raises(SystemExit) as exit_:
        train.checked_config(tree)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err == (
        f"config error: model.init_from={hf['llama']} disagrees with keys this run sets: "
        f"model.dim=48 (the directory's: 32), model.n_layers=3 (the directory's: 2); leave those keys out "
        f"to take the directory's values\n"
    )
    gpt2_into_llama = RunConfig.from_dict(compose_tree(LLAMA + [f"model.init_from={hf['gpt2']}"]))
    with pytest.raises(ConfigError, match=r"holds a gpt2 model but model.family=llama; leave"):
        init_from.check(gpt2_into_llama.model)
    with pytest.raises(ConfigError, match="model.init_from=/no/such/dir: /no/such/dir is not a directory"):
        compose_tree(GPT2 + ["model.init_from=/no/such/dir"])  # the architecture is read as it composes
    resuming = compose_tree(GPT2 + ["model.init_from=/no/such/dir", "checkpoint.resume=/some/ckpt"])
    assert train.checked_config(resuming).model.init_from == "/no/such/dir"  # a resume never reads it


def _export_matches(ckpt: Path, out: Path) -> None:
    done = hf_export.export(ckpt, out)
    assert sorted(done.files) == ["config.json", "generation_config.json", "model.safetensors"]
    ours = sampling.load_model(ckpt)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    theirs.eval()
    x = tokens(ours.cfg, 3, ours.cfg.seq_len, 7)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x).logits) <= 1e-5
    prompt = tokens(ours.cfg, 1, 4, 8)
    greedy = theirs.generate(
        prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt)
    )
    assert greedy[0].tolist() == sampling.generate(ours, prompt[0].tolist(), 12, temperature=0)


def test_export_of_every_layout_loads_in_transformers_with_our_logits_and_tokens(trained, tmp_path):
    d = trained["dirs"]
    _export_matches(_ckpt(d["gpt2"], 6), tmp_path / "gpt2")  # ZeRO-3, tied
    _export_matches(_ckpt(d["llama"], 6), tmp_path / "llama")  # 2 pipeline stages
    _export_matches(_ckpt(d["init_gpt2_tp2"], 2), tmp_path / "tp2")  # 2 tensor-parallel ranks
    _export_matches(_ckpt(d["qwen3"], 6), tmp_path / "qwen3")  # Qwen3, 2 tensor-parallel ranks


def _one_line_error(proc) -> str:
    assert proc.returncode == 1 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    return proc.stderr


def test_export_cli_refuses_minigpt_and_an_existing_output(trained, tmp_path):
    out = tmp_path / "out"
    proc = run_script("scripts/export_hf.py", str(_ckpt(trained["dirs"]["gpt2"], 3)), str(out))
    assert proc.returncode == 0 and proc.stdout.startswith(f"wrote {out}: gpt2, "), proc.stderr
    assert "refusing to overwrite existing" in _one_line_error(
        run_script("scripts/export_hf.py", str(_ckpt(trained["dirs"]["gpt2"], 3)), str(out))
    )
    minigpt = _one_line_error(run_script("scripts/export_hf.py", str(FIXTURE), str(tmp_path / "mini")))
    assert "MiniGPT has no exact Hugging Face equivalent: its LM head has a bias" in minigpt
    inside = _one_line_error(run_script("scripts/export_hf.py", str(FIXTURE), str(FIXTURE / "hf")))
    assert f"refusing to write {FIXTURE / 'hf'} inside checkpoint {FIXTURE}" in inside
    damaged = tmp_path / "damaged"
    shutil.copytree(_ckpt(trained["dirs"]["gpt2"], 3), damaged)
    shard = damaged / "rank00001.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[-3] ^= 0xFF
    shard.write_bytes(bytes(blob))
    assert "rank00001.safetensors has sha256" in _one_line_error(
        run_script("scripts/export_hf.py", str(damaged), str(tmp_path / "from_damaged"))
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "out"]


def test_out_dir_appears_complete_or_not_at_all(trained, tmp_path, monkeypatch):
    """The files are written elsewhere (OUT_DIR does not exist while they are), then renamed; a
    write that fails leaves nothing, temporaries included."""
    out, seen = tmp_path / "out", []

    def fail_midway(cfg, tensors, work):
        seen.append(out.exists())
        (work / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(hf_export, "save_hf_dir", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        hf_export.export(_ckpt(trained["dirs"]["gpt2"], 3), out)
    assert seen == [False] and list(tmp_path.iterdir()) == []
