"""Mixtral, computing what transformers' ``MixtralForCausalLM`` computes (eager attention, no
sliding window, router jitter 0).

Llama's model (``llama.py``: token embedding, pre-RMSNorm blocks with rotary grouped-query
attention, final RMSNorm, LM head without bias) with each block's SwiGLU MLP replaced by a sparse
mixture of ``model.n_experts`` SwiGLU experts, each token sent to ``model.top_k`` of them
(``moe.MoE``). In training, with targets, the loss is the cross-entropy plus
``model.router_aux_loss_coef`` x the load-balancing loss of every block's routing
(``moe.balance``), as transformers' loss with ``output_router_logits=True``, always the whole
step's batch: with one micro-batch and no pipeline, counted in the forward; with
``train.grad_accum`` > 1 or ``dist.pp`` > 1, whose forwards each see a part of the routing, counted
by a forward without gradients first (``routing_count``; ``step_balance`` then holds the counts,
each block charges its share of the loss to the backward and the forward adds the step's value).
In eval mode (the held-out loss) it is the cross-entropy alone: the balance term regularises
training and says nothing of the text.

Each training forward keeps the batch's load-balancing loss and tokens per expert and block
(``routing_log``; counted first: one entry per step); ``step_fields`` turns the last
micro-batches' into the step record's ``aux_loss`` and ``expert_tokens``. ``batch``, when set
(``families.join_batch_``), is the group over which the routing is counted (dp x cp); unset, one
rank's tokens.
"""

from __future__ import annotations

from collections import deque
from functools import partial

import torch
import torch.nn as nn

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import llama, moe
from distlib.app.model.layers import CausalLM, PreNormBlock
from distlib.app.model.strategies import LOCAL, Strategies
from distlib.comm.group import Comm
from distlib.parallel.documents import Documents
from distlib.parallel.dropout import Draws
from distlib.parallel.tensor_parallel import Column, Row

# Attention as Llama's; each expert by hidden units (w1, w3 column-parallel, w2 row-parallel). The
# router is replicated: its input and so its routing are the same bytes on every tensor-parallel rank.
TENSOR_PARALLEL_PLAN = {k: v for k, v in llama.TENSOR_PARALLEL_PLAN.items() if ".attn." in k} | {
    "blocks.*.mlp.experts.*.w1": Column(),
    "blocks.*.mlp.experts.*.w3": Column(),
    "blocks.*.mlp.experts.*.w2": Row(routed=True),
}
LOG_LENGTH = 4096  # micro-batches of routing kept for the step record (more than any step holds)


class Mixtral(CausalLM):
    ATTENTION = llama.Attention  # Qwen3-MoE: Qwen3's (qwen3_moe.py)

    def __init__(self, cfg: ModelConfig, strategies: Strategies = LOCAL):
        super().__init__(cfg, strategies)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(
            PreNormBlock(
                cfg,
                llama.rms_norm,
                self.ATTENTION,
                self.feed_forward(cfg, i, strategies),
                index=i,
                strategies=strategies,
            )
            for i in range(cfg.n_layers)
        )
        self.ln_f = llama.rms_norm(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._init_and_tie()
        self.batch: Comm | None = None
        # per training forward: [load-balancing loss, tokens per (block, expert)...], float64
        self.routing_log: deque[torch.Tensor] = deque(maxlen=LOG_LENGTH)
        self.step_balance: moe.StepBalance | None = None  # set by routing_count (each block holds it too)

    def feed_forward(self, cfg: ModelConfig, index: int, strategies: Strategies):
        """Block ``index``'s MLP factory: every block's a mixture of experts (DeepSeek-V3: not all)."""
        return partial(moe.MoE, sequence=strategies.sequence, loads=strategies.loads)

    def _embed(
        self, tokens: torch.Tensor, positions: torch.Tensor, draws: Draws | None, documents
    ) -> torch.Tensor:
        return self.tok_emb(tokens)  # positions enter as rotary angles, in each attention

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        draws: Draws | None = None,
        documents: Documents | None = None,
    ):
        out = super().forward(tokens, targets, positions, draws, documents)
        if targets is None or not self.training or self.cfg.balance == "bias":  # (bias: no loss term)
            return out
        if self.step_balance is not None:  # the blocks charged their shares to the backward
            return self.train_loss(out)
        layers = [b.mlp for b in self.blocks if isinstance(b.mlp, moe.MoE)]
        dropped = [m.last_dropped for m in layers] if self.cfg.capacity_factor is not None else None
        found = moe.balance([m.last_routing for m in layers], self.cfg.n_experts, self.batch, dropped)
        kept = [found.value.view(1), found.counts.flatten()] + ([found.dropped] if dropped else [])
        self.routing_log.append(torch.cat(kept))
        # transformers adds coef x aux to the cross-entropy in the same order: loss += coef * aux
        return out + self.cfg.router_aux_loss_coef * found.loss

    def train_loss(self, ce: torch.Tensor) -> torch.Tensor:
        """A training micro-batch's loss from its cross-entropy when the step's routing was counted
        first: plus coef x the step's load-balancing loss, a value (its gradient is charged by the
        blocks); the micro-batches' mean is then the whole batch's loss."""
        if self.step_balance is None:
            return ce
        return ce + self.cfg.router_aux_loss_coef * self.step_balance.value

    def step_fields(self, micro_batches: int) -> dict:
        """The step record's MoE fields from the last ``micro_batches`` training forwards (older
        ones, e.g. of a step rolled back, are dropped): ``aux_loss``, their mean load-balancing loss
        (transformers' ``aux_loss``, before the coefficient), and ``expert_tokens``, per block the
        tokens each expert received, summed over them and over the batch group (per MoE block:
        ``model.moe_layers``)."""
        kept = list(self.routing_log)[-micro_batches:]
        self.routing_log.clear()
        if not kept:
            return {}
        rows = torch.stack(kept).tolist()  # one read of the device
        sums = [sum(r[1 + i] for r in rows) for i in range(len(rows[0]) - 1)]
        e, blocks = self.cfg.n_experts, len(self.cfg.moe_layers)  # every block's, on a pipeline stage too
        fields = {
            "aux_loss": sum(r[0] for r in rows) / len(rows),
            "expert_tokens": [[round(c) for c in sums[b * e : (b + 1) * e]] for b in range(blocks)],
        }
        if self.cfg.capacity_factor is not None:
            fields["dropped_tokens"] = [round(c) for c in sums[blocks * e :]]
        return fields


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state_dict entry's shape (a tied lm_head.weight included), without building a model."""
    d, h = cfg.dim, cfg.mlp_width
    shapes = {}
    for name, shape in llama.param_shapes(cfg).items():
        if ".mlp." not in name:
            shapes[name] = shape
        elif name.endswith("mlp.down_proj.weight"):  # the MLP's place: the router, then each expert
            block = name.removesuffix("down_proj.weight")
            shapes[block + "gate.weight"] = (cfg.n_experts, d)
            for e in range(cfg.n_experts):
                expert = f"{block}experts.{e}."
                shapes.update(
                    {expert + "w1.weight": (h, d), expert + "w2.weight": (d, h), expert + "w3.weight": (h, d)}
                )
    return shapes
