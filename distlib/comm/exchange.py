"""all_to_all: each rank sends every other its own piece of rows, of any size (tokens routed to
experts, a sequence's chunks to context-parallel ranks), received in rank order; torch's
``all_to_all_single``. Re-exported by ``collectives``, where the other collectives are."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from distlib.comm import native, tally
from distlib.comm.algorithms import all_to_all as A2A
from distlib.comm.algorithms.base import received_into
from distlib.comm.execution import execution, nothing
from distlib.comm.execution import flat as flat_of
from distlib.comm.group import Comm
from distlib.comm.header import collective


def _rows(splits: list[int], width: int) -> list[tuple[int, int]]:
    """Consecutive pieces of ``splits[j]`` rows of ``width`` elements, as flat (start, end)."""
    ends = [0]
    for rows in splits:
        ends.append(ends[-1] + rows * width)
    return list(zip(ends[:-1], ends[1:]))


def all_to_all(
    tensor: Tensor,
    comm: Comm,
    send_splits: list[int],
    recv_splits: list[int] | None = None,
    *,
    algo: str | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Rows (dim 0) of ``tensor`` cut into N consecutive pieces of ``send_splits[j]`` rows, piece j
    sent to group rank j; returns the pieces this rank received, rank 0's first, as a new tensor
    of ``sum(recv_splits)`` rows (torch's ``all_to_all_single``). ``recv_splits``: the rows each
    rank sends here, or None to exchange the counts first (one more all-to-all, of N integers), so
    uneven splits (tokens routed to experts) always agree with what is sent. Copies only: the
    bytes are those of any other algorithm. algo: "direct" (the default: one round) or "pairwise".
    out: the tensor to receive into instead of a new one (``received_into``), returned."""
    n, flat = comm.size, flat_of(tensor)
    if len(send_splits) != n or any(r < 0 for r in send_splits) or sum(send_splits) != tensor.shape[0]:
        rows = tensor.shape[0]
        raise ValueError(
            f"all_to_all: send_splits {list(send_splits)} must be {n} counts >= 0 adding to {rows}"
        )
    if recv_splits is not None and len(recv_splits) != n:
        raise ValueError(f"all_to_all: recv_splits {list(recv_splits)} must be {n} counts")
    name = "torch" if comm.collectives == "torch" else algo or "direct"
    if name != "torch" and name not in A2A.ALGORITHMS:
        raise ValueError(f"unknown all_to_all algorithm {name!r}; expected one of {sorted(A2A.ALGORITHMS)}")
    if n == 1:
        return received_into(out, tuple(tensor.shape), tensor, "all_to_all").copy_(tensor)
    run = native.all_to_all if name == "torch" else execution("all_to_all", name, comm, A2A.ALGORITHMS)
    if comm.dry:  # (a dry group's peers send what this rank sends, without saying so)
        run, recv_splits = nothing, list(send_splits) if recv_splits is None else recv_splits
        tally.note(comm, "all_to_all", flat.numel() * flat.element_size())
    # A row's width from the trailing shape, never from the data: a rank sending no rows still
    # receives rows of that width (an expert rank that got no tokens gets its own tokens' outputs).
    width = math.prod(tensor.shape[1:])
    if recv_splits is not None:  # a wrong ``out`` is refused before anything is sent
        out = received_into(out, (sum(recv_splits), *tensor.shape[1:]), tensor, "all_to_all")
    with collective(comm, "all_to_all", dtype=flat.dtype, algo=name):
        if recv_splits is None:
            counts = torch.tensor(send_splits, dtype=torch.int64, device=tensor.device)
            got = torch.empty(n, dtype=torch.int64, device=tensor.device)
            run(counts, got, comm, _rows([1] * n, 1), _rows([1] * n, 1))
            recv_splits = got.tolist()
            out = received_into(out, (sum(recv_splits), *tensor.shape[1:]), tensor, "all_to_all")
        run(flat, out.view(-1), comm, _rows(send_splits, width), _rows(recv_splits, width))
    return out
