"""The fit check: may this run load a checkpoint? Every difference is listed, nothing is loaded.

Parameters must have the same names and whole shapes (read by name, the flat-layout order does not
matter; a different model config is named key by key; at another pipeline degree, every parameter
of this rank's stage must be in the checkpoint; at another tensor-parallel degree, the model keys
that decide the shapes must agree, as the whole tensors are cut again), and the data stream must
continue exactly: same corpus, seed, global batch and training windows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from distlib.app.config.data_group import TOKENIZERS
from distlib.app.config.model_group import LATENT_KEYS
from distlib.app.config.run import RunConfig
from distlib.app.data.batches import GlobalBatches
from distlib.checkpoint import relayout
from distlib.checkpoint import sharded as checkpoint
from distlib.parallel.flat_layout import FlatLayout
from distlib.parallel.tensor_parallel import Split, full_shape


def _shape(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else "x".join(map(str, shape)) or "scalar"


def _tokenizer(source: dict) -> str:
    if source.get("tokenizer", "bytes") == "bytes":
        return "bytes"
    return f"{source['tokenizer']} with tokenizer.json sha256 {source.get('tokenizer_sha256')}"


def _source_change(saved: dict | None, ours: dict | None) -> str:
    """What differs between two data sources: the text, the tokenizer, or both (of each source of a
    mixture: which ones)."""
    saved, ours = saved or {}, ours or {}
    if "mixture" in (saved.get("kind"), ours.get("kind")):
        return _mixture_change(saved, ours)
    changes = []
    if (saved.get("kind"), saved.get("sha256")) != (ours.get("kind"), ours.get("sha256")):
        changes.append("the text file's content changed")
    if _tokenizer(saved) != _tokenizer(ours):
        changes.append(f"the tokenizer differs: checkpoint {_tokenizer(saved)}, this run {_tokenizer(ours)}")
    return "; ".join(changes) or "another corpus"


def _mixture_change(saved: dict, ours: dict) -> str:
    theirs, mine = saved.get("sources") or [saved], ours.get("sources") or [ours]
    if len(theirs) != len(mine):
        return f"data.mixture: the checkpoint read {len(theirs)} source(s), this run {len(mine)}"
    changed = [f"source {i}: {_source_change(a, b)}" for i, (a, b) in enumerate(zip(theirs, mine)) if a != b]
    return "data.mixture " + "; ".join(changed)


# The model keys that decide the parameters' (full) shapes: what must agree to cut a checkpoint's
# whole tensors for another tensor-parallel degree (the cut pieces' shapes are checked again there).
SHAPE_KEYS = ("family", "vocab_size", "dim", "n_heads", "n_layers", "mlp_ratio", "mlp_hidden", "n_kv_heads")
SHAPE_KEYS += ("head_dim", "tie_embeddings", "n_experts")
SHAPE_KEYS += (*LATENT_KEYS, "first_k_dense_replace", "dense_mlp_hidden", "n_shared_experts")  # deepseek_v3


def check_fits(
    path: Path,
    manifest: dict,
    layouts: list[FlatLayout],
    splits: dict[str, Split],
    cfg: RunConfig,
    data: GlobalBatches,
) -> None:
    """Refuse, listing every difference, a checkpoint whose parameters or data stream differ from
    this run's (``layouts``: the flat layouts this rank holds partitions of, their pieces cut by
    ``splits``). Parameters are compared by name and whole shape, as the relayout reads them. A
    rank that holds the whole model (no pipeline stages, no experts split) also lists the
    checkpoint's parameters it does not have; one that holds a part, or cuts the tensors at another
    tensor-parallel degree, needs the model keys that decide the shapes to agree."""
    problems, model, d = [], dataclasses.asdict(cfg.model), cfg.dist
    whole = d.pp == 1 and d.ep == 1
    if manifest.get("tp", 1) != d.tp or not whole:  # read by name (checkpoint.relayout): the same model?
        for key, value in manifest.get("model", {}).items():
            if key in SHAPE_KEYS and model.get(key) != value:
                problems.append(f"model.{key}: checkpoint {value}, this run {model.get(key)}")
    theirs = {p.name: p.full_shape for held in relayout.holdings(manifest) for p in held.pieces}
    ours = {s.name: full_shape(s.shape, splits.get(s.name)) for layout in layouts for s in layout.slots}
    names = list(theirs) + [n for n in ours if n not in theirs] if whole else list(ours)
    shapes = [
        f"parameter {name}: checkpoint {_shape(theirs.get(name))}, model {_shape(ours.get(name))}"
        for name in names
        if ours.get(name) != theirs.get(name)
    ]
    if shapes and not problems:
        problems += [
            f"model.{key}: checkpoint {value}, this run {model.get(key)}"
            for key, value in manifest.get("model", {}).items()
            if model.get(key) != value
        ]
    _refuse_or_pass(path, problems + shapes + _data_problems(manifest, cfg, data))


def _refuse_or_pass(path: Path, problems: list[str]) -> None:
    if problems:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} does not fit this run, nothing was loaded:\n  " + "\n  ".join(problems)
        )


def _data_problems(manifest: dict, cfg: RunConfig, data: GlobalBatches) -> list[str]:
    """How the checkpoint's data stream differs from this run's (it must continue exactly)."""
    problems = []
    data_config = cfg.data.to_dict()  # (lists, as the manifest's JSON holds them)
    for key, value in manifest.get("data_config", {}).items():
        # A text file is identified by its sha256 (the position's "source"), not by where it
        # or its token file lives, so a moved file still resumes and a changed one does not; an
        # existing tokenizer too (the source records its sha256).
        moved = key == "tokenizer" and cfg.data.pretrained and value not in TOKENIZERS  # same sha256?
        where = key in ("path", "cache_dir", "mixture")  # (a mixture's sources: by sha256 too)
        if not where and not moved and data_config.get(key) != value:
            problems.append(
                f"data.{key}: checkpoint {value}, this run {data_config.get(key)} (a different corpus)"
            )
    skipped = int(manifest.get("skipped_batches", 0))
    saved_position, position = manifest.get("data"), data.position(int(manifest["step"]), skipped)
    if saved_position and saved_position != position:
        if saved_position["global_batch"] != position["global_batch"]:
            problems.append(
                f"global batch: checkpoint {saved_position['global_batch']} sequences per step, this run "
                f"{position['global_batch']}; the data order cannot continue exactly. Set "
                f"train.global_batch={saved_position['global_batch']} (any world size that divides it)"
            )
        if saved_position["seed"] != position["seed"]:
            problems.append(
                f"seed (data order): checkpoint {saved_position['seed']}, this run {position['seed']}"
            )
        theirs_source, our_source = saved_position.get("source"), position.get("source")
        if theirs_source != our_source:
            problems.append(
                f"data source: checkpoint {theirs_source}, this run {our_source} "
                f"({_source_change(theirs_source, our_source)})"
            )
        if saved_position["num_windows"] != position["num_windows"]:
            problems.append(
                f"training windows in the corpus: checkpoint {saved_position['num_windows']}, "
                f"this run {position['num_windows']}"
            )
    return problems
