"""A checkpoint of any layout and world size as a Hugging Face model directory (scripts/export_hf.py).

``export(checkpoint, out)`` verifies the checkpoint, reassembles the whole model's fp32 weights by
name (``relayout.full_tensors``: data-parallel partitions, tensor-parallel pieces and pipeline
stages put back together) and writes config.json, model.safetensors and generation_config.json
(``model.hf_weights.save_hf_dir``), which ``AutoModelForCausalLM.from_pretrained(out)`` loads.
A run that had a BPE tokenizer gets its tokenizer files copied too, from the checkpoint's own copy
(CHECKPOINT/tokenizer/, hashed with the checkpoint, its sha256 the one the data source records);
a missing or different tokenizer is refused.

Everything is written into a temporary directory next to ``out`` and renamed to ``out`` at the end:
``out`` must not exist (nothing is overwritten) and a failed export leaves nothing behind. MiniGPT
is refused with the reason (``hf_config.export_refusal``): it has no exact counterpart.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from distlib.app.checkpointing.manifest_config import manifest_config
from distlib.app.data import bpe
from distlib.app.data.pretrained import PretrainedTokenizer
from distlib.app.model import families
from distlib.app.model.hf_config import HFError, export_refusal
from distlib.app.model.hf_weights import save_hf_dir
from distlib.checkpoint import offline, relayout
from distlib.checkpoint import sharded as checkpoint


@dataclass
class Exported:
    out: Path
    family: str
    params: int
    step: int
    files: list[str]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer_dir(path: Path, manifest: dict) -> Path | None:
    """The checkpoint's own copy of its run's tokenizer, ``CHECKPOINT/tokenizer/`` (files its manifest
    lists, so ``checkpoint.verify`` hashed them), checked against the sha256 its data source records;
    None for a run without one (byte-level or synthetic data)."""
    want = bpe.recorded_sha256(manifest)
    if want is None:
        return None
    own = Path(path) / "tokenizer"
    if not (own / "tokenizer.json").is_file():
        raise HFError(
            f"checkpoint {path} was trained with the tokenizer of sha256 {want} but holds no copy of it "
            f"({own / 'tokenizer.json'}); the export would have no tokenizer"
        )
    have = bpe.tokenizer_sha256(own)
    if have != want:
        raise HFError(
            f"{own / 'tokenizer.json'} has sha256 {have}, but checkpoint {path} was trained with the "
            f"tokenizer of sha256 {want}: not the run's tokenizer"
        )
    return own


def _special_ids(tokenizer: Path | None, manifest: dict) -> dict:
    """An existing tokenizer's BOS and EOS ids, for config.json and generation_config.json (a run's
    own byte-level or BPE tokenizer leaves them unset, as before)."""
    source = (manifest.get("data") or {}).get("source") or {}
    if tokenizer is None or source.get("tokenizer") != "pretrained":
        return {}
    own = PretrainedTokenizer(tokenizer)
    return {"bos_token_id": own.bos_id, "eos_token_id": own.eos_id}


def export(path: Path | str, out: Path | str) -> Exported:
    path, out = Path(path), Path(out)
    offline.check_new_output(out)
    manifest = checkpoint.verify(path)
    cfg = manifest_config(manifest, path)[0]
    reason = export_refusal(cfg)
    if reason:
        raise HFError(f"checkpoint {path}: {reason}")
    tokenizer = tokenizer_dir(path, manifest)
    # (DeepSeek-V3's selection biases, under model.balance=bias, become its routers' correction biases)
    tensors = relayout.full_tensors(path, manifest) | relayout.state_buffers(path, manifest)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_hf_dir(cfg, tensors, work, **_special_ids(tokenizer, manifest))
        for name in bpe.TOKENIZER_FILES if tokenizer else ():
            if (tokenizer / name).is_file():
                shutil.copyfile(tokenizer / name, work / name)
        os.rename(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Exported(
        out,
        cfg.family,
        families.param_count(cfg),
        int(manifest["step"]),
        sorted(p.name for p in out.iterdir()),
    )
