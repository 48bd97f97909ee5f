"""Load a trained model (any family) on one process (no process group) and generate from it.

A sharded checkpoint is verified first (every file's size and sha256 against the manifest), then
the whole model's fp32 parameters are reassembled by name (``relayout.full_tensors``: the
data-parallel partitions concatenated, tensor-parallel pieces joined, pipeline stages put
together, so a checkpoint of any layout and world size loads), and the manifest's model config
(``model.family`` and the shape; an old manifest without a family is MiniGPT) builds the model
they load into. A consolidated ``model.safetensors`` (``scripts/ckpt.py consolidate``) is read
directly; its model config comes from the file's ``model`` metadata (JSON of ModelConfig) or,
failing that, for MiniGPT weights, from the tensor shapes plus an explicit head count.
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors
import torch

from distlib.app.checkpointing.manifest_config import manifest_config
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.schema import ConfigError
from distlib.app.model import families
from distlib.app.model.bias_balance import state_buffers
from distlib.app.model.layers import CausalLM
from distlib.checkpoint import relayout
from distlib.checkpoint import sharded as checkpoint


class SampleError(ValueError):
    """A checkpoint or request that cannot be sampled from, with the reason."""


def model_from_sharded(path: Path) -> CausalLM:
    return model_from_verified(path, checkpoint.verify(path))


def model_from_verified(path: Path, manifest: dict) -> CausalLM:
    """The model a verified checkpoint (``manifest``: what ``sharded.verify`` returned) holds."""
    model = families.build(manifest_config(manifest, path)[0], 0)
    _load_exactly(model, relayout.full_tensors(path, manifest), path)
    buffers = state_buffers(model)  # model.balance=bias: the experts' biases choose the experts
    for name, t in relayout.state_buffers(path, manifest, buffers).items():
        buffers[name].copy_(t)
    return model


def _infer_config(state: dict[str, torch.Tensor], n_heads: int | None, path: Path) -> ModelConfig:
    if n_heads is None:
        raise SampleError(
            f"{path} carries no 'model' metadata; pass the head count (--n-heads) so the "
            f"attention can be rebuilt"
        )
    try:
        vocab, dim = state["tok_emb.weight"].shape
        seq_len = state["pos_emb.weight"].shape[0]
        n_layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
        mlp_ratio = state["blocks.0.mlp.fc.weight"].shape[0] // dim
    except (KeyError, ValueError) as exc:
        raise SampleError(f"{path} does not hold MiniGPT weights: {exc}") from exc
    return ModelConfig(
        vocab_size=vocab, seq_len=seq_len, dim=dim, n_heads=n_heads, n_layers=n_layers, mlp_ratio=mlp_ratio
    )


def model_from_safetensors(path: Path, n_heads: int | None = None) -> CausalLM:
    with safetensors.safe_open(str(path), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata() or {}
    if "model" in meta:
        try:
            cfg = ModelConfig.from_dict(json.loads(meta["model"]))
        except (ConfigError, TypeError, ValueError) as exc:
            raise SampleError(f"{path}: its 'model' metadata is not a valid model config: {exc}") from exc
    else:
        cfg = _infer_config(state, n_heads, path)
    model = families.build(cfg, 0)
    buffers = state_buffers(model)  # model.balance=bias: the experts' biases, beside the weights
    missing = sorted(set(buffers) - set(state))
    if missing:
        raise SampleError(f"{path} has no {missing[0]} for its model.balance=bias model")
    _load_exactly(model, {k: v.float() for k, v in state.items() if k not in buffers}, path)
    for name, t in buffers.items():
        t.copy_(state[name])
    return model


def _load_exactly(model: CausalLM, state: dict[str, torch.Tensor], path: Path) -> None:
    """Load ``state`` (parameters by name: a tied LM head is the embedding, listed once) into
    ``model``, refusing any missing, extra or differently shaped tensor."""
    ours = {k: tuple(p.shape) for k, p in model.named_parameters()}
    theirs = {k: tuple(v.shape) for k, v in state.items() if not (k == "lm_head.weight" and k not in ours)}
    if model.cfg.tie_embeddings and "lm_head.weight" in state and "tok_emb.weight" in state:
        if not torch.equal(state["lm_head.weight"], state["tok_emb.weight"]):
            raise SampleError(
                f"{path}: model.tie_embeddings is true but lm_head.weight differs from tok_emb.weight"
            )
    if ours != theirs:
        diff = [
            f"{k}: file {theirs.get(k)}, model {ours.get(k)}"
            for k in sorted(set(ours) | set(theirs))
            if ours.get(k) != theirs.get(k)
        ]
        raise SampleError(f"{path} does not match the model it describes: " + "; ".join(diff[:5]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name])


def load_model(path: str | Path, n_heads: int | None = None) -> CausalLM:
    """The model in eval mode from a checkpoint directory (sharded, verified) or a .safetensors file."""
    path = Path(path)
    if path.is_dir():
        model = model_from_sharded(path)
    elif path.is_file() and path.suffix == ".safetensors":
        model = model_from_safetensors(path, n_heads)
    elif path.exists():
        raise SampleError(f"{path} is neither a checkpoint directory nor a .safetensors file")
    else:
        raise checkpoint.CheckpointError(f"checkpoint {path} does not exist")
    return model.eval()


@torch.no_grad()
def generate(
    model: CausalLM,
    prompt: list[int],
    new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """``prompt`` followed by ``new_tokens`` sampled tokens. Temperature 0 picks the most likely
    token (greedy); top_k keeps only the k most likely before sampling. The model sees at most
    its last ``seq_len`` tokens."""
    if not prompt:
        raise SampleError("the prompt is empty: give at least one token to continue from")
    if temperature < 0:
        raise SampleError(f"temperature must be >= 0, got {temperature}")
    vocab = model.cfg.vocab_size
    if top_k is not None and not 1 <= top_k:
        raise SampleError(f"top-k must be >= 1, got {top_k}")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise SampleError(f"prompt token(s) {bad[:5]} outside the model's vocabulary [0, {vocab})")
    tokens = list(prompt)
    for _ in range(new_tokens):
        context = torch.tensor(
            [tokens[-model.cfg.seq_len :]], dtype=torch.int64, device=model.lm_head.weight.device
        )
        logits = model(context)[0, -1].double()
        if temperature == 0:
            tokens.append(int(torch.argmax(logits)))
            continue
        logits = logits / temperature
        if top_k is not None and top_k < vocab:
            kth = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokens
