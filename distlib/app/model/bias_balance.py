"""DeepSeek-V3's auxiliary-loss-free load balancing (``model.balance=bias``).

Each MoE block keeps a bias per expert (``moe.MoE.score_bias``) that is added to the router
probabilities to choose a token's experts, and not to weigh them. After each step that the guard
accepts, every block's bias moves by ``model.bias_update_speed`` (gamma) towards the mean load:

    b_e <- b_e + gamma x sign(mean - c_e),    mean = sum_e c_e / n_experts,

c_e the assignments expert e received in the step's training forwards: every micro-batch, and the
tokens of every batch rank (dp x cp). Each block counts its own forwards as they run
(``MoE.step_counts``; a recomputation under activation checkpointing is not counted again,
``recompute``), so nothing runs but the step itself: no counting forward, no loss term. One
all-reduce of the (blocks x experts) counts over the batch ranks and the pipeline stages gives
every rank the step's counts of every block; tensor-parallel ranks route the same tokens, so they
are not summed over. The counts are integers and sign() exact, so every layout moves the biases by
the same bits.

The biases are state that training changes and a checkpoint must keep (``state_buffers``):
``checkpointing.contents`` saves them beside the optimizer state, the loader restores them by name
at any layout.
"""

from __future__ import annotations

import torch

from distlib.app.model.families import moe_blocks
from distlib.app.model.layers import CausalLM
from distlib.comm import collectives
from distlib.comm.mesh import Mesh

STATE = "score_bias"  # the MoE buffer that is state


def state_buffers(model: CausalLM) -> dict[str, torch.Tensor]:
    """This rank's model state that is not a parameter, by name in the whole model: each MoE
    block's selection biases under ``model.balance=bias`` (none otherwise)."""
    return {f"blocks.{i}.mlp.{STATE}": m.score_bias for i, m in moe_blocks(model) if m.score_bias is not None}


def state_names(cfg) -> list[str]:
    """Every state buffer's name in the whole model of ``cfg`` (a ``ModelConfig``), on any rank."""
    if not (cfg.has_experts and cfg.balance == "bias"):
        return []
    return [f"blocks.{i}.mlp.{STATE}" for i in cfg.moe_layers]


class BiasBalance:
    def __init__(self, model: CausalLM, mesh: Mesh, speed: float):
        self.model, self.mesh, self.speed = model, mesh, speed
        self.blocks = moe_blocks(model)
        self.cfg, self.n_experts = model.cfg, model.cfg.n_experts
        self.last: list[list[int]] | None = None

    def count(self, batches: list) -> None:
        """Before the step's forwards: every block's count starts at zero (a step rolled back
        counted too)."""
        for _, m in self.blocks:
            m.step_counts.zero_()

    def update(self) -> None:
        """After the step's update: the step's counts over every rank, and each block's bias moved."""
        rows = len(self.cfg.moe_layers)
        counts = torch.zeros(rows, self.n_experts, dtype=torch.float64, device=self._device())
        for i, m in self.blocks:
            counts[self.cfg.moe_row(i)] = m.step_counts.double()
        for group in (self.mesh.batch, self.mesh.pp):
            if group is not None and group.size > 1:
                collectives.all_reduce(counts, group, op="sum")
        for i, m in self.blocks:
            mine = counts[self.cfg.moe_row(i)]
            m.score_bias += self.speed * torch.sign(mine.sum() / self.n_experts - mine).float()
        self.last = [[round(c) for c in row] for row in counts.tolist()]

    def fields(self) -> dict:
        """The step record's ``expert_tokens`` (per MoE block, the assignments each expert received)."""
        return {"expert_tokens": self.last} if self.last is not None else {}

    def _device(self) -> torch.device:
        return self.blocks[0][1].score_bias.device if self.blocks else torch.device("cpu")
