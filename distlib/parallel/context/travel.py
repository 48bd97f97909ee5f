"""What travels around the ring (``ring``): the keys and values themselves, or the compressed latent
they are expanded from (multi-head latent attention).

A traveller turns its owner's tensors into one flat message (``message``), a visiting message into
the block's keys and values (``kv``), the block's key and value gradients into the gradient message
that travels back to the owner (``grad_message``), and the summed message that arrives home into
the gradients of its inputs (``owner_grads``).

    KeysValues   k and v as they are (one buffer, k's elements then v's: ``Pair``)
    Latent       a latent per token, (batch, tokens, rank), and the rotary key every head shares,
                 (batch, 1, tokens, rope); each rank expands a visiting block with the up-projection
                 (``LatentKV``: kv = latent W^T per head, [key part | value], the key's rotary part
                 appended), and sends back the gradients of the latent and the rotary key, not of
                 the expanded keys and values; the up-projection's gradient from every block a rank
                 expanded stays with it (``weight_grad``). DeepSeek-V3's heads (128 of 192 + 128)
                 from a latent of 512 + 64: 71x fewer bytes a ring step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


class Pair:
    """Two tensors in one flat buffer, the first's elements then the second's: one message a step
    whatever their shapes. For equal shapes it is ``torch.stack([a, b])``'s memory, and the views
    have the same strides."""

    def __init__(self, a_shape, b_shape):
        self.a_shape, self.b_shape = tuple(a_shape), tuple(b_shape)
        self.split = math.prod(self.a_shape)
        self.numel = self.split + math.prod(self.b_shape)

    def pack(self, a: Tensor, b: Tensor) -> Tensor:
        return torch.cat([a.reshape(-1), b.reshape(-1)])

    def views(self, buf: Tensor) -> tuple[Tensor, Tensor]:
        return buf[: self.split].view(self.a_shape), buf[self.split :].view(self.b_shape)


class KeysValues:
    def __init__(self, k: Tensor, v: Tensor):
        self.k, self.v, self.pair = k, v, Pair(k.shape, v.shape)
        self.grad_numel = self.pair.numel

    def message(self) -> Tensor:
        return self.pair.pack(self.k, self.v)

    def kv(self, buf: Tensor) -> tuple[Tensor, Tensor]:
        return self.pair.views(buf)

    def grad_message(self, dk: Tensor, dv: Tensor, buf: Tensor) -> Tensor:
        return self.pair.pack(dk, dv)

    def owner_grads(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        return self.pair.views(flat)


@dataclass(frozen=True)
class LatentKV:
    """The up-projection of multi-head latent attention: ``weight`` (heads x (nope + v_dim), rank)
    maps a latent to every head's key part without positions (nope wide) and its value (v_dim)."""

    weight: Tensor
    nope: int
    v_dim: int

    def expand(self, latent: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
        """(k, v), (batch, heads, tokens, nope + rope) and (batch, heads, tokens, v_dim), from the
        latent (batch, tokens, rank) and the shared rotary key (batch, 1, tokens, rope)."""
        batch, tokens, _ = latent.shape
        kv = F.linear(latent, self.weight).view(batch, tokens, -1, self.nope + self.v_dim)
        k_pass, v = torch.split(kv.transpose(1, 2), [self.nope, self.v_dim], dim=-1)
        return torch.cat([k_pass, k_rot.expand(-1, k_pass.shape[1], -1, -1)], dim=-1), v

    def heads(self, first: int, count: int) -> LatentKV:
        """The up-projection of heads ``first`` to ``first + count`` only (their rows of ``weight``:
        the all-to-all route expands a rank's share of the heads)."""
        rows = self.nope + self.v_dim
        return LatentKV(self.weight[first * rows : (first + count) * rows], self.nope, self.v_dim)


class Latent:
    def __init__(self, latent: Tensor, k_rot: Tensor, up: LatentKV, acc: torch.dtype):
        self.latent, self.k_rot, self.up, self.acc = latent, k_rot, up, acc
        self.pair = Pair(latent.shape, k_rot.shape)
        self.grad_numel = self.pair.numel
        self.weight_grad = torch.zeros(up.weight.shape, dtype=acc, device=latent.device)

    def message(self) -> Tensor:
        return self.pair.pack(self.latent, self.k_rot)

    def kv(self, buf: Tensor) -> tuple[Tensor, Tensor]:
        return self.up.expand(*self.pair.views(buf))

    def grad_message(self, dk: Tensor, dv: Tensor, buf: Tensor) -> Tensor:
        """The visiting block's latent and rotary-key gradients from its keys' and values'; the
        up-projection's gradient from this block added to ``weight_grad``."""
        latent = self.pair.views(buf)[0].to(self.acc)
        batch, tokens, rank = latent.shape
        # (batch, heads, tokens, nope + v) -> (batch x tokens, heads x (nope + v)), as kv was laid out
        dkv = torch.cat([dk[..., : self.up.nope], dv], dim=-1).transpose(1, 2).reshape(batch * tokens, -1)
        self.weight_grad += dkv.t() @ latent.reshape(batch * tokens, rank)
        d_latent = (dkv @ self.up.weight.to(self.acc)).view(batch, tokens, rank)
        d_rot = dk[..., self.up.nope :].sum(dim=1, keepdim=True)  # every head's share of the shared key
        return self.pair.pack(d_latent, d_rot)

    def owner_grads(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        return self.pair.views(flat)
