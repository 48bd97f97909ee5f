"""What a checked collective's header says, in int64 words, and how a mismatch is told: each
rank's call (kind, numel, dtype, op, root, algorithm, bounds) coded by ``distlib.comm.header``'s
``collective`` and described in words when the members' calls differ."""

from __future__ import annotations

import zlib

import torch

from distlib.comm.group import KINDS, Comm
from distlib.comm.p2p import CollectiveMismatchError

OPS = ("sum", "avg", "max", "min")
ALGOS = ("direct", "ring", "exchange", "tree", "chain", "rabenseifner", "halving", "bruck", "flat", "scatter")
ALGOS += ("torch",)  # torch's own collective (native): added last, so the codes above keep theirs
# The header's codes by index; a value outside a table is coded by a checksum (>= 1000), which
# still mismatches correctly and is printed as the raw code.
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def check_op(op: str, dtype: torch.dtype) -> None:
    """A reduction op every collective knows (and the header can code), valid for ``dtype``."""
    if op not in OPS:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {OPS}")
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"op 'avg' needs a floating dtype, got {dtype}")


def code(value, table) -> int:
    return (
        -1
        if value is None
        else table.index(value)
        if value in table
        else 1000 + zlib.crc32(str(value).encode()) % 10**6
    )


def describe(header: list[int]) -> str:
    """One rank's call in words; ``header`` is the list ``collective`` builds, in this order."""
    call, kind, numel, dtype, op, src, algo, layout = header
    parts = [f"numel={numel}"] if numel >= 0 else []
    parts += (
        [f"dtype={str(DTYPES[dtype]).replace('torch.', '') if 0 <= dtype < len(DTYPES) else dtype}"]
        if dtype >= 0
        else []
    )
    parts += [f"op={OPS[op] if op < len(OPS) else op}"] if op >= 0 else []
    parts += [f"src={src}"] if src >= 0 else []
    parts += [f"algo={ALGOS[algo] if algo < len(ALGOS) else algo}"] if algo >= 0 else []
    parts += [f"bounds#{layout}"] if layout >= 0 else []
    name = KINDS[kind] if 0 <= kind < len(KINDS) else f"kind#{kind}"
    return f"{name}({', '.join(parts)})" + (f" as collective #{call}" if call >= 0 else "")


def mismatch(comm: Comm, kind: str, headers: list[list[int]]) -> None:
    """Raise the same CollectiveMismatchError on every rank if any member's header differs."""
    if any(h != headers[0] for h in headers):
        calls = "; ".join(
            f"rank {j} (global {comm.peer(j)}) called {describe(h)}" for j, h in enumerate(headers)
        )
        raise CollectiveMismatchError(
            f"{kind}: mismatched collective in group {list(comm.ranks)}: {calls}", kind, agreed=True
        )
