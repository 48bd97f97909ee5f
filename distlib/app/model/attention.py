"""The one causal attention every family calls, after its projections (and Llama's rotary).

Two paths. The explicit one (scores, masked_fill, softmax, dropout, weights @ v) is what every
family runs: each tensor-parallel layout and each device then does the same arithmetic, and for
GPT-2 and Llama it is transformers' "eager" attention. What the families differ in is an
argument, not a copy of the code: MiniGPT divides the scores by sqrt(head_dim) where transformers
multiplies by its inverse (the two round differently), and Llama takes the softmax in float32.
The other path is torch's fused ``scaled_dot_product_attention`` (``sdpa=True``): the same function
within rounding (tests/test_model_seams.py), which no family selects yet -- it changes the bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(seq_len: int) -> torch.Tensor:
    """True where a query may attend (key position <= query position). Made on the CPU whatever the
    default device, so every device starts from the same buffer; it moves with the model."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device="cpu").tril()


def split_heads(t: torch.Tensor, head_size: int) -> torch.Tensor:
    """(batch, seq, local heads * head_size) -> (batch, local heads, seq, head_size). The head count
    comes from the width, so a column-parallel shard (fewer heads) runs the same code."""
    batch, seq, _ = t.shape
    return t.view(batch, seq, -1, head_size).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_size) -> (batch, seq, heads * head_size), as transformers' reshape."""
    batch, _, seq, _ = t.shape
    return t.transpose(1, 2).reshape(batch, seq, -1).contiguous()


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    divide: bool = False,
    softmax_dtype: torch.dtype | None = None,
    dropout: float = 0.0,
    training: bool = False,
    sdpa: bool = False,
) -> torch.Tensor:
    """softmax(q @ k^T * scale, causal) @ v with heads merged: q, k, v (batch, heads, seq, head_dim),
    k and v already repeated to q's heads; the result (batch, seq, heads * head_dim). ``divide``:
    scores / scale instead. ``softmax_dtype``: the softmax's dtype, cast back to v's. ``dropout`` on
    the attention weights while ``training``. ``mask`` is ``causal_mask`` (the explicit path reads its
    top-left seq x seq corner)."""
    if sdpa:
        p = dropout if training else 0.0
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=p, is_causal=True, scale=1.0 / scale if divide else scale
        )
        return merge_heads(out)
    seq = q.shape[-2]
    scores = q @ k.transpose(-2, -1)
    scores = scores / scale if divide else scores * scale
    # transformers adds the dtype's minimum instead of writing -inf; after the softmax both give
    # exactly 0 there (exp underflows), and a causal row always keeps its diagonal.
    scores = scores.masked_fill(~mask[:seq, :seq], float("-inf"))
    weights = F.softmax(scores, dim=-1, dtype=softmax_dtype).to(v.dtype)
    weights = F.dropout(weights, dropout, training)
    return merge_heads(weights @ v)
