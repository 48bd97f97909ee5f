"""Multi-head latent attention (DeepSeek-V2/V3), computing what transformers' DeepseekV3Attention
(eager, default RoPE, ``rope_interleave=true``) computes.

    queries   q_proj(x), or with ``model.q_lora_rank`` q_b_proj(RMSNorm(q_a_proj(x))): per head
              qk_nope_head_dim + qk_rope_head_dim wide, split into a part without positions and a
              rotary part
    keys,     one compressed latent per token, kv_a_proj_with_mqa(x) = [c | k_rope]: c
    values    (kv_lora_rank wide) through an RMSNorm and kv_b_proj gives every head's key part
              without positions and its value (v_head_dim); k_rope (qk_rope_head_dim) is rotated
              and shared by every head
    rotary    on the query's and the shared key's rotary parts, in interleaved pairs (x0, x1),
              (x2, x3)... each pair turned by one frequency of qk_rope_head_dim's table, the
              results laid out as [evens | odds] (transformers' apply_rotary_pos_emb_interleave:
              queries and keys in the same order, so their dot products are the pairs')
    attention scores scaled by (qk_nope_head_dim + qk_rope_head_dim)^-0.5, softmax in float32
              (``attention.causal_attention``: every context-parallel route), then o_proj

The two latent RMSNorms use eps 1e-6 whatever ``model.norm_eps`` (transformers builds them with
DeepseekV3RMSNorm's default). Tensor parallelism splits the heads: q_proj / q_b_proj and kv_b_proj
by output rows, o_proj by input columns; the latent projections and norms run whole on every rank,
and the normed latent and the shared rotary key enter the region as a column layer's input does
(``latent_in``, ``rope_key``: ``SharedInput``), so each rank's heads' gradients meet in its backward.

The keys and values are expanded from the latent by kv_b_proj's weight where the context attends
(``attention.latent_causal_attention``): in place on one rank and for the all-to-all route, after
the latent travelled for the ring (``parallel.context.latent_ring``: kv_lora_rank + rope values a
token instead of heads x (nope + rope + v)).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import attention, llama
from distlib.app.model.attention import causal_mask
from distlib.app.model.layers import in_documents, positions_or_default
from distlib.parallel.context.travel import LatentKV
from distlib.parallel.documents import Documents
from distlib.parallel.dropout import Draws
from distlib.parallel.tensor_parallel import Column, Row, Shared, SharedInput

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which transformers' latent norms keep


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The rotary inverse frequencies of the qk_rope_head_dim-wide part, float32 on the CPU."""
    d = cfg.qk_rope_head_dim
    return 1.0 / (float(cfg.rope_theta) ** (torch.arange(0, d, 2, dtype=torch.float, device="cpu") / d))


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., seq, d) rotated pair by pair ((x0, x1) by the first angle...), laid out [evens | odds];
    cos, sin (seq, d / 2)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def tensor_parallel_plan(cfg: ModelConfig) -> dict:
    """The heads split; the normed latent and the shared rotary key enter the region (``Shared``)."""
    query = (
        {"blocks.*.attn.q_proj": Column()}
        if cfg.q_lora_rank is None
        else {"blocks.*.attn.q_b_proj": Column()}
    )
    return query | {
        "blocks.*.attn.kv_b_proj": Column(),
        "blocks.*.attn.o_proj": Row(),
        "blocks.*.attn.rope_key": Shared(),
        "blocks.*.attn.latent_in": Shared(),
    }


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, context: attention.Context = attention.WHOLE):
        super().__init__()
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        qk = self.nope + self.rope
        self.scale = qk**-0.5
        heads = cfg.n_heads
        self.low_rank_queries = cfg.q_lora_rank is not None
        if not self.low_rank_queries:
            self.q_proj = nn.Linear(cfg.dim, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = llama.RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = llama.RMSNorm(self.kv_lora, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, cfg.dim, bias=False)
        self.rope_key = SharedInput()
        # the latent enters the tensor-parallel region here: kv_b_proj's module is not called, its
        # (column-parallel) weight is (LatentKV), where the context attends
        self.latent_in = SharedInput()
        self.dropout = cfg.dropout
        self.register_buffer("causal_mask", causal_mask(cfg.seq_len), persistent=False)
        self.context = context  # dist.cp > 1: attention.ContextSplit (strategies.py)
        self.register_buffer("inv_freq", inv_frequencies(cfg), persistent=False)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, local heads x (nope + rope))."""
        if self.low_rank_queries:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        draws: Draws | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.queries(x).view(batch, seq, -1, self.nope + self.rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora, self.rope], dim=-1)
        positions = positions_or_default(positions, seq, x.device)
        cos, sin = llama.rope_tables(self.inv_freq, in_documents(positions, documents), q.dtype)
        cos, sin = cos[..., : self.rope // 2], sin[..., : self.rope // 2]  # one angle per pair
        q_rot = rotate_interleaved(q_rot, cos, sin)
        k_rot = self.rope_key(rotate_interleaved(k_rot.view(batch, 1, seq, self.rope), cos, sin))
        # the keys and values are expanded from the latent where the context attends (the ring
        # sends the latent: attention.latent_causal_attention); kv_b_proj holds the up-projection
        up = LatentKV(self.kv_b_proj.weight, self.nope, self.v_dim)
        out = attention.latent_causal_attention(
            torch.cat([q_pass, q_rot], dim=-1),
            self.latent_in(self.kv_a_layernorm(latent)),
            k_rot,
            up,
            self.causal_mask,
            scale=self.scale,
            softmax_dtype=torch.float32,
            dropout=self.dropout,
            training=self.training,
            context=self.context,
            draws=draws,
            documents=documents,
        )
        return self.o_proj(out)

    def sequence_sharded_parameters(self) -> list[nn.Parameter]:
        """With dist.sp the latent projections and norms see the gathered tokens whole, but the
        gradient that reaches them is this rank's heads' only (the column layers after them do not
        all-reduce: the block's gather sums their inputs' gradients): summed over tp."""
        latent = [self.kv_a_proj_with_mqa, self.kv_a_layernorm]
        if self.low_rank_queries:
            latent = [self.q_a_proj, self.q_a_layernorm, *latent]
        return [p for m in latent for p in m.parameters()]


def param_shapes(cfg: ModelConfig, block: str) -> dict[str, tuple[int, ...]]:
    """The attention's state_dict entries of block ``block`` ('blocks.<i>.'), in order."""
    d, heads, qk = cfg.dim, cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    a = block + "attn."
    if cfg.q_lora_rank is None:
        shapes = {a + "q_proj.weight": (heads * qk, d)}
    else:
        r = cfg.q_lora_rank
        shapes = {
            a + "q_a_proj.weight": (r, d),
            a + "q_a_layernorm.weight": (r,),
            a + "q_b_proj.weight": (heads * qk, r),
        }
    kv = cfg.kv_lora_rank
    return shapes | {
        a + "kv_a_proj_with_mqa.weight": (kv + cfg.qk_rope_head_dim, d),
        a + "kv_a_layernorm.weight": (kv,),
        a + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv),
        a + "o_proj.weight": (d, heads * cfg.v_head_dim),
    }
