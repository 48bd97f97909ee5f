"""The same step with communication skipped: our collectives replaced by local no-ops.

``local_collectives()`` swaps the public functions of ``distlib.comm.collectives`` (every caller
looks them up there at call time) for versions that touch only this rank's data, keeping every
shape: all_reduce and broadcast leave the tensor as it is (as if every rank held the same
values), reduce_scatter returns this rank's chunk of its own tensor, all_gather writes this rank's
chunk and zeros elsewhere (zeros, not stale memory: denormals would slow the compute), and
all_gather_bytes returns this rank's payload N times. Nothing is sent, so the ranks' models drift
apart: such a step is timed, never checked for its loss. ``exposed communication = step time -
no-comm step time``: the part of the communication that nothing hid.
"""

from __future__ import annotations

import contextlib

from distlib.comm import collectives


def _all_reduce(tensor, comm, op="sum", *, algo=None):
    return tensor


def _broadcast(tensor, src, comm, *, algo=None):
    return tensor


def _reduce_scatter(tensor, comm, op="sum", *, algo=None, bounds=None):
    flat = tensor.reshape(-1)
    lo, hi = (bounds or collectives.chunk_bounds(flat.numel(), comm.size))[comm.rank]
    return flat[lo:hi].clone()


def _all_gather(output, chunk, comm, *, algo=None, bounds=None):
    flat = output.view(-1)
    lo, hi = (bounds or collectives.chunk_bounds(flat.numel(), comm.size))[comm.rank]
    mine = chunk.reshape(-1)
    if mine.data_ptr() != flat[lo:hi].data_ptr():
        flat.zero_()
        flat[lo:hi].copy_(mine)
    return output


def _all_gather_bytes(payload, comm):
    return [payload] * comm.size


LOCAL = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "reduce_scatter": _reduce_scatter,
    "all_gather": _all_gather,
    "all_gather_bytes": _all_gather_bytes,
}


@contextlib.contextmanager
def local_collectives():
    saved = {name: getattr(collectives, name) for name in LOCAL}
    for name, fn in LOCAL.items():
        setattr(collectives, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(collectives, name, fn)
