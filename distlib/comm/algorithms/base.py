"""What the algorithms share: combining two operands, the rank-order fold, pipeline segments,
and the virtual ranks of the recursive-halving / doubling algorithms."""

from __future__ import annotations

import torch
from torch import Tensor

from distlib.comm.group import Comm

_COMBINE = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}


def combine(a: Tensor, b: Tensor, op: str, out: Tensor) -> None:
    _COMBINE[op](a, b, out=out)


def fold(parts: list[Tensor], me: int, op: str, out: Tensor) -> Tensor:
    """out = ((parts[0] . parts[1]) . parts[2]) ... in rank order, the same on every rank.
    Until our own part is folded in, accumulate into parts[0] (a receive buffer unless
    me == 0), so ``out`` may alias parts[me] -- as it does when reducing in place."""
    acc = parts[0]
    for j in range(1, len(parts)):
        dst = out if j >= me else parts[0]
        combine(acc, parts[j], op, dst)
        acc = dst
    return out


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """(start, end) per part, tensor_split style: the first numel % parts parts get one extra."""
    base, extra = divmod(numel, parts)
    ends = [0]
    for i in range(parts):
        ends.append(ends[-1] + base + (1 if i < extra else 0))
    return list(zip(ends[:-1], ends[1:]))


def segments(n: int, itemsize: int, seg_bytes: int) -> list[tuple[int, int]]:
    """(start, end) pieces of at most ``seg_bytes`` covering n elements (one empty piece if n == 0)."""
    seg = max(1, seg_bytes // itemsize)
    return [(s, min(s + seg, n)) for s in range(0, n, seg)] or [(0, 0)]


def empty(n: int, like: Tensor) -> Tensor:
    return torch.empty(n, dtype=like.dtype, device=like.device)


def received_into(out: Tensor | None, shape: tuple[int, ...], like: Tensor, name: str) -> Tensor:
    """Where collective ``name`` puts what it receives: ``out`` when given (checked: ``shape``,
    ``like``'s dtype and device, contiguous), else a new tensor. A caller receiving the same shape
    again saves the allocation: 64 MB fresh costs more than copying them (page faults, the kernel's
    zeroing)."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or (out.dtype, out.device) != (like.dtype, like.device):
        raise ValueError(
            f"{name}: out must be a {like.dtype} tensor of shape {list(shape)} on {like.device}; "
            f"got {out.dtype} {list(out.shape)} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous")
    return out


class Virtual:
    """Recursive halving / doubling on any N (Rabenseifner; Thakur et al. 2005): with p the largest
    power of two <= N and rem = N - p, ranks 2i and 2i+1 (i < rem) act as one virtual rank i (the
    odd one takes part, the even one waits), and rank r >= 2 rem is virtual rank r - rem. Virtual
    rank v owns the chunks of the ranks it stands for, a contiguous run ``chunks(v)``; ``span``
    turns a run of virtual ranks into an element range through ``bounds``."""

    def __init__(self, comm: Comm, bounds: list[tuple[int, int]]):
        n = comm.size
        self.p = 1 << (n.bit_length() - 1)
        self.rem = n - self.p
        self.bounds, self.me = bounds, comm.rank
        self.idle = self.me < 2 * self.rem and self.me % 2 == 0  # folded into me + 1
        self.v = self.me // 2 if self.me < 2 * self.rem else self.me - self.rem

    def real(self, v: int) -> int:
        """The rank that acts for virtual rank v."""
        return 2 * v + 1 if v < self.rem else v + self.rem

    def chunks(self, v: int) -> tuple[int, int]:
        return (2 * v, 2 * v + 2) if v < self.rem else (v + self.rem, v + self.rem + 1)

    def span(self, v0: int, v1: int) -> tuple[int, int]:
        """Elements owned by virtual ranks v0 .. v1-1."""
        return self.bounds[self.chunks(v0)[0]][0], self.bounds[self.chunks(v1 - 1)[1] - 1][1]
