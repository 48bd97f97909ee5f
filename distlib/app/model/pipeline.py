"""A model cut into pipeline chunks: what one pipeline rank keeps, and how a chunk runs.

Every rank builds the whole model from the seed, as at ``dist.pp=1`` (so the kept parameters
start from the same bytes and the losses match), then ``keep_stage_`` drops what other ranks run.
With P ranks and v chunks per rank the n_layers blocks form S = P x v equal, contiguous global
stages; chunk c of rank r is global stage c x P + r (``distlib.parallel.pipeline.schedule``).
The embeddings (the family's ``EMBEDDINGS`` modules) go with stage 0, the final norm, the LM head
(``HEAD``) and the loss with stage S-1; a chunk runs them through the model's own ``embed`` and
``head``, so every family's stage computes what its forward computes.

The kept blocks stay under ``blocks.<i>`` (a ModuleDict keyed by the block's index in the whole
model), so parameter names are the whole model's: the tensor-parallel plan matches them and a
checkpoint maps every parameter to its place at any other pipeline degree by name.

Tied weights: with ``model.tie_embeddings`` the first stage's embedding and the last stage's LM
head would be one weight on two ranks, whose gradient would have to be summed across them; that
layout is refused (``config.run``), so the stages share no parameter.
"""

from __future__ import annotations

import json

import torch
import torch.nn as nn

from distlib.app.model.layers import CausalLM
from distlib.comm import agree
from distlib.comm.mesh import Mesh
from distlib.parallel.documents import Documents
from distlib.parallel.dropout import Draws
from distlib.parallel.flat_layout import FlatLayout
from distlib.parallel.pipeline.schedule import stage_block_ids
from distlib.parallel.tensor_parallel import Split, manifest_layouts


class Chunk(nn.Module):
    """One global stage: (the model's ``embed`` if first) -> its blocks -> (``head`` if last). The
    first takes tokens, the others the previous stage's activation; the last returns logits
    (``layers.lm_loss`` is the forward's loss on them). It holds the stage model's own modules (their hooks
    fire as at pp = 1); the optimizer is built over the stage model, not the chunks."""

    def __init__(self, model: CausalLM, block_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.embeddings = nn.ModuleList(getattr(model, n) for n in model.EMBEDDINGS) if first else None
        self.blocks = nn.ModuleList(model.blocks[str(i)] for i in block_ids)
        self.head_modules = nn.ModuleList(getattr(model, n) for n in model.HEAD) if last else None
        self._embed, self._head = model.embed, model.head  # bound methods: no module registered twice
        self.first, self.last = first, last

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        draws: Draws | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        if self.first:
            x = self._embed(x, positions, draws, documents)
        for block in self.blocks:
            x = block(x, positions, draws, documents)
        return self._head(x) if self.last else x


def keep_stage_(model: CausalLM, pp: int, virtual: int, rank: int) -> list[Chunk]:
    """Drop (in place) every part of ``model`` that pipeline rank ``rank`` does not run; return
    its chunks in chunk order. Parameter names and their relative order are the whole model's."""
    ids = stage_block_ids(model.cfg.n_layers, pp, virtual, rank)
    kept = [i for chunk in ids for i in chunk]
    model.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in sorted(kept)})
    first, last = rank == 0, rank == pp - 1
    for name in (() if first else model.EMBEDDINGS) + (() if last else model.HEAD):
        setattr(model, name, None)
    return [Chunk(model, chunk, first and c == 0, last and c == virtual - 1) for c, chunk in enumerate(ids)]


def stage_layouts(mesh: Mesh, layout: FlatLayout, tp_splits: dict[str, Split]) -> dict:
    """The manifest's pipeline fields (collective over the world; {} without pipeline parallelism):
    ``pp``, and ``pp_layouts[stage][tp_rank]``, each stage's flat layout (with the
    tensor-parallel splits, as ``tp_layouts``), which is how a checkpoint finds every parameter
    by name when it is loaded at another pipeline degree."""
    if mesh.pp is None:
        return {}
    mine = manifest_layouts(layout.to_dict(), tp_splits)[mesh.tp.rank] if tp_splits else layout.to_dict()
    every = [json.loads(blob) for blob in agree.gather_bytes(json.dumps(mine).encode(), mesh.world)]
    grid = mesh.layout
    return {
        "pp": grid.pp,
        "pp_layouts": [[every[grid.rank(pp=s, tp=t)] for t in range(grid.tp)] for s in range(grid.pp)],
    }
