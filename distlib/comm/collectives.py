"""Hand-written collectives on torch.distributed point-to-point (isend/irecv).

Every function takes a ``Comm`` and talks only to its members, addressing them by global
rank (``comm.peer(i)``) on ``comm.group``. torch's own collectives are never called here;
they are the reference in the tests and the benchmark.

Default algorithm by tensor bytes B and world size N (``choose_algorithm``; each public
function also takes ``algo=`` to force one, which the tests do at every size):

| collective     | algorithm | when (defaults)               | levels of waiting | bytes sent per rank |
|----------------|-----------|-------------------------------|-------------------|---------------------|
| all_reduce     | exchange  | (N-1) B <= 4 MiB              | 1                 | (N-1) B             |
| all_reduce     | direct    | otherwise, N=2 or B <= 4 MiB  | 2                 | 2 (N-1)/N B         |
| all_reduce     | ring      | N > 2 and B > 4 MiB           | 2 (N-1)           | 2 (N-1)/N B         |
| reduce_scatter | direct    | N = 2 or B <= 4 MiB           | 1                 | (N-1)/N B           |
| reduce_scatter | ring      | N > 2 and B > 4 MiB           | N-1, pipelined    | (N-1)/N B           |
| all_gather     | direct    | N = 2 or B <= 4 MiB           | 1                 | (N-1)/N B           |
| all_gather     | ring      | N > 2 and B > 4 MiB           | N-1, pipelined    | (N-1)/N B           |
| broadcast      | tree      | N = 2 or B <= 4 MiB           | ceil(log2 N)      | <= ceil(log2 N) B   |
| broadcast      | chain     | N > 2 and B > 4 MiB           | N-1, pipelined    | B                   |

Why: every gloo message costs tens of microseconds, and every level of waiting costs a
wake-up of a sleeping process -- milliseconds when ranks outnumber cores (4 ranks on 2
here). Small tensors therefore want one level (exchange / direct) even at the price of
more bytes; large ones want each byte to cross each link once, in SEGMENT_BYTES pieces so
that forwarding and reducing one piece overlaps receiving the next (ring / chain). With 2
ranks ring and direct send the same messages, so segmenting would only add overhead.
The thresholds are the module constants below, picked from benchmarks/collectives.py
(--algos times every algorithm at every size).

Bitwise agreement: after all_reduce, broadcast and all_gather every rank holds identical
bytes. Direct and ring reduce-scatter reduce each element on exactly one rank (its owner)
and all-gather then copies it; exchange has every rank reduce all N contributions in the
same rank order 0..N-1 (which direct reduce-scatter also uses, so exchange and direct
all_reduce agree with each other too). avg = sum, then divide by N (on the owner).

Uneven splits: reduce_scatter and all_gather take ``bounds=`` (one contiguous (start, end)
per rank, possibly empty), so ZeRO-2/3 can reduce a bucket straight into each rank's
partition; the default is the even split of ``chunk_bounds``.

Devices: temporaries are allocated where the tensor lives; ``p2p.P2P`` stages tensors (CUDA over
gloo) and, with NCCL (``comm.batched``), posts a round's messages as one batch.

Underneath: ``p2p.P2P`` posts the messages and turns a failed wait (a peer that timed out or
died) into ``CollectiveError`` naming the collective, this rank and the peer; every outermost
call runs in ``header.collective``, which counts it (``comm.stats``) and, with ``comm.check``,
raises the same ``CollectiveMismatchError`` on every rank when ranks called different ones.
"""
from __future__ import annotations

import torch
from torch import Tensor

from distlib.comm.group import Comm
from distlib.comm.header import check_op, collective
from distlib.comm.p2p import P2P

AR_EXCHANGE_MAX_BYTES = 4 << 20      # all_reduce: exchange while each rank sends (N-1) B <= this
DIRECT_MAX_BYTES = 4 << 20           # reduce_scatter / all_gather: direct up to here, then ring
BCAST_TREE_MAX_BYTES = 4 << 20       # broadcast: binomial tree up to here, then chain
SEGMENT_BYTES = 1 << 20              # pipeline granularity of ring / chain


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """(start, end) per part, tensor_split style: the first numel % parts parts get one extra."""
    base, extra = divmod(numel, parts)
    ends = [0]
    for i in range(parts):
        ends.append(ends[-1] + base + (1 if i < extra else 0))
    return list(zip(ends[:-1], ends[1:]))


def _combine(a: Tensor, b: Tensor, op: str, out: Tensor) -> None:
    fn = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    fn(a, b, out=out)


def _fold(parts: list[Tensor], me: int, op: str, out: Tensor) -> Tensor:
    """out = ((parts[0] . parts[1]) . parts[2]) ... in rank order, the same on every rank.
    Until our own part is folded in, accumulate into parts[0] (a receive buffer unless
    me == 0), so ``out`` may alias parts[me] -- as it does when reducing in place."""
    acc = parts[0]
    for j in range(1, len(parts)):
        dst = out if j >= me else parts[0]
        _combine(acc, parts[j], op, dst)
        acc = dst
    return out


def _segments(n: int, itemsize: int) -> list[tuple[int, int]]:
    seg = max(1, SEGMENT_BYTES // itemsize)
    return [(s, min(s + seg, n)) for s in range(0, n, seg)] or [(0, 0)]


def choose_algorithm(collective: str, nbytes: int, world: int) -> str:
    """The algorithm a collective uses by default for ``nbytes`` on ``world`` ranks (see table).
    With 2 ranks ring == direct and chain == tree, except that segmenting adds messages."""
    big = world > 2 and nbytes > (BCAST_TREE_MAX_BYTES if collective == "broadcast" else DIRECT_MAX_BYTES)
    if collective == "broadcast":
        return "chain" if big else "tree"
    if collective == "all_reduce":
        return "exchange" if (world - 1) * nbytes <= AR_EXCHANGE_MAX_BYTES else "ring" if big else "direct"
    if collective in ("reduce_scatter", "all_gather"):
        return "ring" if big else "direct"
    raise ValueError(f"unknown collective {collective!r}")


def _pick(collective: str, algo: str | None, flat: Tensor, comm: Comm, table: dict):
    name = algo or choose_algorithm(collective, flat.numel() * flat.element_size(), comm.size)
    if name not in table:
        raise ValueError(f"unknown {collective} algorithm {name!r}; expected one of {sorted(table)}")
    return name, table[name]


def _flat(t: Tensor) -> Tensor:
    if not t.is_contiguous():
        raise ValueError("collectives need a contiguous tensor")
    return t.view(-1)


# --------------------------------------------------------------------------- reduce_scatter

def _rs_direct(flat: Tensor, comm: Comm, op: str, out: Tensor, bounds: list[tuple[int, int]]) -> None:
    """Send chunk j straight to rank j; the owner reduces all N parts in rank order 0..N-1."""
    p2p, n, me = P2P("reduce_scatter", comm), comm.size, comm.rank
    lo, hi = bounds[me]
    parts = [flat[lo:hi] if j == me else torch.empty(hi - lo, dtype=flat.dtype, device=flat.device) for j in range(n)]
    handles = [p2p.recv(parts[j], j) for j in range(n) if j != me]
    handles += [p2p.send(flat[a:b], j) for j, (a, b) in enumerate(bounds) if j != me]
    p2p.wait(*handles)
    _fold(parts, me, op, out)


def _rs_ring(flat: Tensor, comm: Comm, op: str, out: Tensor, bounds: list[tuple[int, int]]) -> None:
    """Ring: at step s pass the partial sum of chunk (me-s-1) right and fold ours into the one
    arriving from the left; after N-1 steps chunk `me` has visited every rank. Each step is
    split in segments so reducing one segment overlaps receiving the next."""
    p2p, n, me = P2P("reduce_scatter", comm), comm.size, comm.rank
    right, left = me + 1, me - 1
    width = max(b - a for a, b in bounds)
    bufs = [torch.empty(width, dtype=flat.dtype, device=flat.device) for _ in range(2)]
    sending = flat[slice(*bounds[(me - 1) % n])]        # step 0 sends our own contribution
    for step in range(n - 1):
        lo, hi = bounds[(me - step - 2) % n]
        incoming = bufs[step % 2][: hi - lo]
        segs = _segments(hi - lo, flat.element_size())
        recvs = [p2p.recv(incoming[a:b], left) for a, b in segs]
        sends = [p2p.send(sending[a:b], right) for a, b in _segments(sending.numel(), flat.element_size())]
        dst = out if step == n - 2 else incoming          # the last step completes our chunk
        for (a, b), h in zip(segs, recvs):
            p2p.wait(h)
            _combine(incoming[a:b], flat[lo + a: lo + b], op, dst[a:b])
        p2p.wait(*sends)
        sending = incoming


def _check_bounds(bounds: list[tuple[int, int]] | None, numel: int, comm: Comm, name: str) -> list[tuple[int, int]]:
    """``bounds`` (one (start, end) per rank, contiguous, covering the tensor, possibly empty or
    uneven) or, when None, the even split of chunk_bounds."""
    if bounds is None:
        return chunk_bounds(numel, comm.size)
    bounds = [(int(a), int(b)) for a, b in bounds]
    ends = [0] + [b for _, b in bounds]
    if len(bounds) != comm.size or any(a != e or b < a for (a, b), e in zip(bounds, ends)) or ends[-1] != numel:
        raise ValueError(f"{name}: bounds {bounds} must be {comm.size} contiguous (start, end) pairs "
                         f"covering [0, {numel})")
    return bounds


def reduce_scatter(tensor: Tensor, comm: Comm, op: str = "sum", *, algo: str | None = None,
                   bounds: list[tuple[int, int]] | None = None) -> Tensor:
    """This rank's chunk (``bounds[rank]``, default chunk_bounds(numel, N)[rank]) of the elementwise
    reduction, as a new 1-D tensor. ``tensor`` is read only. algo: None (by size), "direct" or
    "ring". Uneven ``bounds`` let ZeRO reduce a bucket straight into each rank's partition."""
    check_op(op, tensor.dtype)
    flat = _flat(tensor)
    custom = bounds is not None
    bounds = _check_bounds(bounds, flat.numel(), comm, "reduce_scatter")
    lo, hi = bounds[comm.rank]
    out = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
    with collective(comm, "reduce_scatter", numel=flat.numel(), dtype=flat.dtype, op=op,
                     algo=algo or choose_algorithm("reduce_scatter", flat.numel() * flat.element_size(), comm.size),
                     bounds=bounds if custom else None):
        return _reduce_scatter(flat, comm, op, algo, out, bounds)


def _reduce_scatter(flat: Tensor, comm: Comm, op: str, algo: str | None, out: Tensor,
                    bounds: list[tuple[int, int]]) -> Tensor:
    """Reduce this rank's chunk into ``out``, which may be that chunk of ``flat`` itself."""
    _, run = _pick("reduce_scatter", algo, flat, comm, {"direct": _rs_direct, "ring": _rs_ring})
    lo, hi = bounds[comm.rank]
    if comm.size == 1:
        return out.copy_(flat[lo:hi])
    run(flat, comm, op, out, bounds)
    if op == "avg":
        out.div_(comm.size)     # once, on the owner, so every rank later gets the same bytes
    return out


# --------------------------------------------------------------------------- all_gather

def _ag_direct(flat: Tensor, comm: Comm, bounds: list[tuple[int, int]]) -> None:
    """Everyone sends its chunk to everyone, in one round, straight into `flat`."""
    p2p, me = P2P("all_gather", comm), comm.rank
    mine = flat[slice(*bounds[me])]
    handles = [p2p.recv(flat[a:b], j) for j, (a, b) in enumerate(bounds) if j != me]
    handles += [p2p.send(mine, j) for j in range(comm.size) if j != me]
    p2p.wait(*handles)


def _ag_ring(flat: Tensor, comm: Comm, bounds: list[tuple[int, int]]) -> None:
    """Ring: chunk (me-s) travels right at step s. All receives land in their final place in
    `flat`, so they are posted up front and each segment is forwarded as soon as it lands."""
    p2p, n, me = P2P("all_gather", comm), comm.size, comm.rank

    def segs(chunk):
        lo, hi = bounds[chunk % n]
        return [flat[lo + a: lo + b] for a, b in _segments(hi - lo, flat.element_size())]

    incoming = [segs(me - s - 1) for s in range(n - 1)]         # chunk received at step s
    # Batched (NCCL: a round's messages go out together) step s's receives are posted at step s,
    # with the forwards of step s - 1; otherwise all up front.
    recvs = [[p2p.recv(t, me - 1) for t in step] for step in incoming[:1 if comm.batched else n - 1]]
    sends = [p2p.send(t, me + 1) for t in segs(me)]
    for s in range(n - 1):
        if s >= len(recvs):
            recvs.append([p2p.recv(t, me - 1) for t in incoming[s]])
        for t, h in zip(incoming[s], recvs[s]):
            p2p.wait(h)
            if s < n - 2:                                       # the last chunk stops here
                sends.append(p2p.send(t, me + 1))
    p2p.wait(*sends)


def all_gather(output: Tensor, chunk: Tensor, comm: Comm, *, algo: str | None = None,
               bounds: list[tuple[int, int]] | None = None) -> Tensor:
    """Fill ``output`` (flat) on every rank from each rank's ``chunk``, which lands at
    ``bounds[rank]`` (default: the even split). ``chunk`` may be the view of ``output`` at this
    rank's position. algo: None (by size), "direct" or "ring"."""
    flat = _flat(output)
    custom = bounds is not None
    bounds = _check_bounds(bounds, flat.numel(), comm, "all_gather")
    lo, hi = bounds[comm.rank]
    if chunk.numel() != hi - lo:
        raise ValueError(f"all_gather: rank {comm.rank} chunk has {chunk.numel()} elements, "
                         f"expected {hi - lo} of {flat.numel()}")
    name, run = _pick("all_gather", algo, flat, comm, {"direct": _ag_direct, "ring": _ag_ring})
    mine = flat[lo:hi]
    if chunk.data_ptr() != mine.data_ptr() or chunk.dtype != mine.dtype:
        mine.copy_(chunk.reshape(-1))       # (casts to output's dtype if they differ)
    if comm.size > 1:
        with collective(comm, "all_gather", numel=flat.numel(), dtype=flat.dtype, algo=name,
                         bounds=bounds if custom else None):
            run(flat, comm, bounds)
    return output


# --------------------------------------------------------------------------- all_reduce

def _ar_exchange(flat: Tensor, comm: Comm, op: str) -> None:
    """Everyone sends the whole tensor to everyone; each rank reduces in rank order 0..N-1,
    so all ranks perform the identical sequence of operations and agree bitwise."""
    p2p, me = P2P("all_reduce", comm), comm.rank
    parts = [flat if j == me else torch.empty_like(flat) for j in range(comm.size)]
    handles = [p2p.recv(parts[j], j) for j in range(comm.size) if j != me]
    handles += [p2p.send(flat, j) for j in range(comm.size) if j != me]
    p2p.wait(*handles)                      # all sends done: now `flat` may be overwritten
    _fold(parts, me, op, flat)
    if op == "avg":
        flat.div_(comm.size)


def _ar_via(algo: str):
    """reduce_scatter into our own chunk of the tensor, then all_gather it in place."""
    def run(flat: Tensor, comm: Comm, op: str) -> None:
        bounds = chunk_bounds(flat.numel(), comm.size)
        _reduce_scatter(flat, comm, op, algo, flat[slice(*bounds[comm.rank])], bounds)
        {"direct": _ag_direct, "ring": _ag_ring}[algo](flat, comm, bounds)
    return run


def all_reduce(tensor: Tensor, comm: Comm, op: str = "sum", *, algo: str | None = None) -> Tensor:
    """In place; every rank ends with identical bytes. algo: None (by size), "exchange",
    "direct" or "ring" (the last two: reduce_scatter + all_gather with that algorithm)."""
    check_op(op, tensor.dtype)
    flat = _flat(tensor)
    table = {"exchange": _ar_exchange, "direct": _ar_via("direct"), "ring": _ar_via("ring")}
    name, run = _pick("all_reduce", algo, flat, comm, table)
    if comm.size > 1:
        with collective(comm, "all_reduce", numel=flat.numel(), dtype=flat.dtype, op=op, algo=name):
            run(flat, comm, op)
    return tensor


# --------------------------------------------------------------------------- broadcast

def _bcast_tree(flat: Tensor, src: int, comm: Comm) -> None:
    """Binomial tree: relative rank v gets the data from v minus its highest bit, then passes
    it to v + 2^k for every 2^k > v; log2 N levels, sends never waited on one by one."""
    p2p, n = P2P("broadcast", comm), comm.size
    v = (comm.rank - src) % n                       # position relative to the root
    if v:
        p2p.wait(p2p.recv(flat, src + v - (1 << (v.bit_length() - 1))))
    kids = [v + (1 << k) for k in range(v.bit_length(), n.bit_length()) if v + (1 << k) < n]
    p2p.wait(*[p2p.send(flat, src + kid) for kid in reversed(kids)])   # biggest subtree first


def _bcast_chain(flat: Tensor, src: int, comm: Comm) -> None:
    """Pipelined chain root -> root+1 -> ...: each segment is forwarded as soon as it lands,
    so the time is ~(segments + N - 2) segment transfers instead of log2 N full ones."""
    p2p, n = P2P("broadcast", comm), comm.size
    v = (comm.rank - src) % n
    segs = [flat[a:b] for a, b in _segments(flat.numel(), flat.element_size())]
    recvs = [p2p.recv(t, comm.rank - 1) if v else None for t in segs]
    sends = []
    for t, h in zip(segs, recvs):
        p2p.wait(h)
        if v < n - 1:                               # the last rank of the chain only receives
            sends.append(p2p.send(t, comm.rank + 1))
    p2p.wait(*sends)


def broadcast(tensor: Tensor, src: int, comm: Comm, *, algo: str | None = None) -> Tensor:
    """In place on every rank from group rank ``src``. algo: None (by size), "tree" or "chain"."""
    if not 0 <= src < comm.size:
        raise ValueError(f"broadcast: src {src} is not a group rank of {list(comm.ranks)}")
    flat = _flat(tensor)
    name, run = _pick("broadcast", algo, flat, comm, {"tree": _bcast_tree, "chain": _bcast_chain})
    if comm.size > 1:
        with collective(comm, "broadcast", numel=flat.numel(), dtype=flat.dtype, src=src, algo=name):
            run(flat, src, comm)
    return tensor


# --------------------------------------------------------------------------- bytes

def all_gather_bytes(payload: bytes, comm: Comm) -> list[bytes]:
    """Every rank's ``payload`` (any length), indexed by group rank, on every rank."""
    n = comm.size
    with collective(comm, "all_gather_bytes"):
        lengths = torch.zeros(n, dtype=torch.int64, device="cpu")
        all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64, device="cpu"), comm)
        width = int(lengths.max())
        buf = torch.zeros(n * width, dtype=torch.uint8, device="cpu")
        mine = buf[comm.rank * width: comm.rank * width + len(payload)]
        if payload:
            mine.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        all_gather(buf, buf[comm.rank * width:(comm.rank + 1) * width], comm)
    raw = buf.numpy().tobytes()
    return [raw[j * width: j * width + int(lengths[j])] for j in range(n)]
