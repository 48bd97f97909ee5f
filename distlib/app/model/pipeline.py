"""MiniGPT cut into pipeline chunks: what one pipeline rank keeps, and how a chunk runs.

Every rank builds the whole model from the seed, as at ``dist.pp=1`` (so the kept parameters
start from the same bytes and the losses match), then ``keep_stage_`` drops what other ranks run.
With P ranks and v chunks per rank the n_layers blocks form S = P x v equal, contiguous global
stages; chunk c of rank r is global stage c x P + r (``distlib.parallel.pipeline.schedule``).
The embeddings go with stage 0, the final LayerNorm, the LM head and the loss with stage S-1.

The kept blocks stay under ``blocks.<i>`` (a ModuleDict keyed by the block's index in the whole
model), so parameter names are the whole model's: the tensor-parallel plan matches them and a
checkpoint maps every parameter to its place at any other pipeline degree by name.

Tied weights: MiniGPT's LM head is its own Linear, not tied to ``tok_emb`` (model.py), so the
first and last stages share no parameter and no gradient needs to cross between them.
"""

from __future__ import annotations

import json

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlib.app.model.minigpt import MiniGPT
from distlib.comm import agree
from distlib.comm.mesh import Mesh
from distlib.parallel.flat_layout import FlatLayout
from distlib.parallel.tensor_parallel import Split, manifest_layouts


def stage_block_ids(n_layers: int, pp: int, virtual: int, rank: int) -> list[list[int]]:
    """The block indices of each of ``rank``'s chunks (chunk c is global stage c * pp + rank)."""
    per = n_layers // (pp * virtual)
    return [list(range((c * pp + rank) * per, (c * pp + rank + 1) * per)) for c in range(virtual)]


class Chunk(nn.Module):
    """One global stage: (embeddings if first) -> its blocks -> (final norm and head if last).
    The first takes tokens, the others the previous stage's activation; the last returns logits
    (``lm_loss`` is ``MiniGPT.forward``'s loss on them). It holds the stage model's own modules
    (their hooks fire as at pp = 1); the optimizer is built over the stage model, not the chunks."""

    def __init__(self, model: MiniGPT, block_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.tok_emb, self.pos_emb = (model.tok_emb, model.pos_emb) if first else (None, None)
        self.blocks = nn.ModuleList(model.blocks[str(i)] for i in block_ids)
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if last else (None, None)
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy, as ``MiniGPT.forward`` computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def keep_stage_(model: MiniGPT, pp: int, virtual: int, rank: int) -> list[Chunk]:
    """Drop (in place) every part of ``model`` that pipeline rank ``rank`` does not run; return
    its chunks in chunk order. Parameter names and their relative order are the whole model's."""
    ids = stage_block_ids(model.cfg.n_layers, pp, virtual, rank)
    kept = [i for chunk in ids for i in chunk]
    model.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in sorted(kept)})
    first, last = rank == 0, rank == pp - 1
    if not first:
        model.tok_emb = model.pos_emb = None
    if not last:
        model.ln_f = model.lm_head = None
    return [Chunk(model, chunk, first and c == 0, last and c == virtual - 1) for c, chunk in enumerate(ids)]


def stage_layouts(mesh: Mesh, layout: FlatLayout, tp_splits: dict[str, Split]) -> dict:
    """The manifest's pipeline fields (collective over the world; {} without pipeline parallelism):
    ``pp``, the rank order, and ``pp_layouts[stage][tp_rank]``, each stage's flat layout (with the
    tensor-parallel splits, as ``tp_layouts``), which is how a checkpoint finds every parameter
    by name when it is loaded at another pipeline degree."""
    if mesh.pp is None:
        return {}
    mine = manifest_layouts(layout.to_dict(), tp_splits)[mesh.tp.rank] if tp_splits else layout.to_dict()
    every = [json.loads(blob) for blob in agree.gather_bytes(json.dumps(mine).encode(), mesh.world)]
    tp, per_stage = mesh.tp.size, mesh.world.size // mesh.pp.size
    return {
        "pp": mesh.pp.size,
        "rank_order": "global rank = (pp_rank * dp + dp_rank) * tp + tp_rank",
        "pp_layouts": [[every[s * per_stage + t] for t in range(tp)] for s in range(mesh.pp.size)],
    }
