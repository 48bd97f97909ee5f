"""DeepSeek-V3, computing what transformers' ``DeepseekV3ForCausalLM`` computes (eager attention,
default RoPE, rope_interleave, no multi-token-prediction layers).

Mixtral's model (``mixtral.Mixtral``: token embedding, pre-RMSNorm blocks, final RMSNorm, LM head)
with DeepSeek's parts:

    attention   multi-head latent attention (``mla.Attention``)
    blocks      the first ``model.first_k_dense_replace`` with a dense SwiGLU MLP of
                ``model.dense_mlp_hidden``; the rest with ``MoE``
    MoE         ``n_shared_experts`` x the experts' width of shared SwiGLU MLP that every token goes
                through, added to the routed experts' weighted sum (transformers' order: routed +
                shared); the routed experts chosen by DeepSeek's router (``routers.SigmoidGroupTopK``:
                sigmoid scores, group-limited top-k, ``routed_scaling_factor``)

transformers' model has no load-balancing loss: DeepSeek-V3 balances with the bias rule
(``model.balance=bias``, ``bias_balance``), whose biases are its routers'
``e_score_correction_bias`` (``hf_weights``). With ``model.balance=aux`` the whole-step loss of
``moe.balance`` reads each token's scores normalised to sum to 1.

Every MoE layout Mixtral runs in runs here: the routed experts spread over ``dist.ep`` (the shared
ones are dense parameters, on every rank), tensor parallelism splits the heads, the dense MLPs and
the shared and routed experts by hidden units (``tensor_parallel_plan``: a pipeline stage's plan
names only the kinds of block it holds).
"""

from __future__ import annotations

from functools import partial

import torch

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import expert_loads, llama, mixtral, mla, moe
from distlib.app.model.strategies import Strategies
from distlib.parallel.sequence_parallel import SequenceSplit
from distlib.parallel.tensor_parallel import REPLICATED, Column, Replicated, Row

DENSE_PLAN = {k: v for k, v in llama.TENSOR_PARALLEL_PLAN.items() if ".mlp." in k}
EXPERTS_PLAN = {k: v for k, v in mixtral.TENSOR_PARALLEL_PLAN.items() if ".mlp." in k} | {
    "blocks.*.mlp.shared_experts.gate_proj": Column(),
    "blocks.*.mlp.shared_experts.up_proj": Column(),
    "blocks.*.mlp.shared_experts.down_proj": Row(),
}


def tensor_parallel_plan(cfg: ModelConfig, blocks) -> dict:
    """The plan of a model (stage) holding ``blocks`` (their indices in the whole model)."""
    held = list(blocks)
    plan = mla.tensor_parallel_plan(cfg)
    if any(i < cfg.first_k_dense_replace for i in held):
        plan |= DENSE_PLAN
    if any(i >= cfg.first_k_dense_replace for i in held):
        plan |= EXPERTS_PLAN
    return plan


class MoE(moe.MoE):
    """The routed experts (``moe.MoE``, with the family's router) plus the shared ones."""

    def __init__(
        self,
        cfg: ModelConfig,
        sequence: Replicated | SequenceSplit = REPLICATED,
        loads: expert_loads.Loads = expert_loads.READ,
    ):
        super().__init__(cfg, sequence, loads)
        self.shared_experts = llama.MLP(cfg, width=cfg.mlp_width * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (with dist.sp both sums are this rank's tokens: the routed part is cut to them after the
        # experts' all-reduce, the shared part reduce-scattered by its row layer)
        return super().forward(x) + self.shared_experts(x)


class DeepseekV3(mixtral.Mixtral):
    ATTENTION = mla.Attention

    def feed_forward(self, cfg: ModelConfig, index: int, strategies: Strategies):
        if index < cfg.first_k_dense_replace:
            return partial(llama.MLP, width=cfg.dense_width)
        return partial(MoE, sequence=strategies.sequence, loads=strategies.loads)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state_dict entry's shape (a tied lm_head.weight included), without building a model."""
    d, h = cfg.dim, cfg.mlp_width
    shapes = {"tok_emb.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        b = f"blocks.{i}."
        shapes[b + "ln1.weight"] = (d,)
        shapes |= mla.param_shapes(cfg, b)
        shapes[b + "ln2.weight"] = (d,)
        if i < cfg.first_k_dense_replace:
            shapes |= _mlp_shapes(b + "mlp.", d, cfg.dense_width)
            continue
        shapes[b + "mlp.gate.weight"] = (cfg.n_experts, d)
        for e in range(cfg.n_experts):
            x = f"{b}mlp.experts.{e}."
            shapes |= {x + "w1.weight": (h, d), x + "w2.weight": (d, h), x + "w3.weight": (h, d)}
        shapes |= _mlp_shapes(b + "mlp.shared_experts.", d, h * cfg.n_shared_experts)
    return shapes | {"ln_f.weight": (d,), "lm_head.weight": (cfg.vocab_size, d)}


def _mlp_shapes(prefix: str, d: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (width, d),
        prefix + "up_proj.weight": (width, d),
        prefix + "down_proj.weight": (d, width),
    }
