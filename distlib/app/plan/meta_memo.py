"""Shape inference remembered: the meta device's kernels are functions of their inputs' shapes,
strides and dtypes alone, but many run as Python (torch's reference implementations), and a dry
step repeats the same operators on the same shapes -- every block like the one before, every
layout like the last (a 2-block llama micro-batch's counted dry step: 24 ms, 10 ms remembered).
``MetaMemo`` answers an operator it has seen with the same inputs with new tensors of the
remembered shapes, strides and storage sizes. ``timing.OpCounter`` can answer so itself (``key_of``,
``remember``, ``made``), remembering its counts beside the shapes.

Only operators that make new tensors are answered so (their schema's results alias nothing, and
they are not among the few views whose schemas do not say so): a view or an in-place result is
the input's own storage, which the activation meters count by identity, so those always run. So
do operators on any tensor not on the meta device.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SEEN: dict = {}  # (operator, its inputs' description) -> its results' description
_LIMIT = 200_000  # entries (a few hundred bytes each); past it, nothing more is remembered


class MetaMemo(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = key_of(func, args, kwargs)
        seen = _SEEN.get(key) if key is not None else None
        if seen is not None:
            return made(seen[0])
        out = func(*args, **kwargs)
        if key is not None:
            remember(_SEEN, key, out)
        return out


def remember(memory: dict, key, out, *extra) -> None:
    """Keep in ``memory`` under ``key`` the description of the operator's results ``out`` (and
    ``extra``, what a caller counted of it), while it has room; results not on the meta device
    are not kept."""
    if len(memory) >= _LIMIT:
        return
    described = _described(out)
    if described is not None:
        memory[key] = (described, *extra)


# operators whose results share their input's storage though their schemas do not say so
UNSAID_VIEWS = {
    "aten::_unsafe_view",
    "aten::unsafe_split",
    "aten::unsafe_split_with_sizes",
    "aten::unsafe_chunk",
}


def key_of(func, args, kwargs):
    """What the operator's meta kernel sees, hashable; None: not to be answered from memory."""
    if not _answerable(func):
        return None
    try:
        parts = (func, _arg(args), _arg(tuple(sorted(kwargs.items()))) if kwargs else ())
        hash(parts)
    except _NotMeta:
        return None
    except TypeError:  # an argument that cannot be told apart by value
        return None
    return parts


_ANSWERABLE: dict = {}  # operator -> whether its results may come from memory (asked once each)


def _answerable(func) -> bool:
    """Whether ``func`` makes new tensors: its schema's results alias nothing, and it is not one
    of the views whose schemas do not say so."""
    known = _ANSWERABLE.get(func)
    if known is None:
        schema = func._schema
        aliases = any(r.alias_info is not None for r in schema.returns)
        known = _ANSWERABLE[func] = not (schema.name in UNSAID_VIEWS or aliases)
    return known


class _NotMeta(Exception):
    pass


def _arg(value):
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            raise _NotMeta
        return ("T", value.shape, value.stride(), value.dtype, value.storage_offset())
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *map(_arg, value))
    return value


def _described(out):
    """The results' shapes, strides, dtypes, offsets and storage sizes (None: not remembered)."""
    if isinstance(out, torch.Tensor):
        if out.device.type != "meta":
            return None
        storage, offset = out.untyped_storage().nbytes(), out.storage_offset()
        if offset == 0 and storage == _strided_bytes(out):  # (most: ``made`` takes one call, 1.0 us for 2.8)
            return ("S", tuple(out.shape), out.stride(), out.dtype)
        return ("T", tuple(out.shape), out.stride(), out.dtype, offset, storage)
    if isinstance(out, (tuple, list)):
        parts = [_described(o) for o in out]
        return None if any(p is None for p in parts) else (type(out).__name__, parts)
    if out is None or isinstance(out, (int, float, bool)):
        return ("V", out)
    return None


def _strided_bytes(t: torch.Tensor) -> int:
    """The storage ``torch.empty_strided`` gives a tensor of ``t``'s shape, strides and dtype."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * step for size, step in zip(t.shape, t.stride()))) * t.element_size()


def made(described):
    kind = described[0]
    if kind == "S":
        _, shape, stride, dtype = described
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if kind == "T":
        _, shape, stride, dtype, offset, nbytes = described
        storage = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        return torch.empty(0, dtype=dtype, device="meta").set_(storage, offset, shape, stride)
    if kind == "V":
        return described[1]
    parts = [made(p) for p in described[1]]
    return tuple(parts) if kind == "tuple" else parts
