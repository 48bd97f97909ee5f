"""What every outermost collective does around its algorithm: count it, and check that all ranks
called the same one.

``collective(comm, kind, ...)`` is the context each public collective runs its algorithm in.
With ``comm.stats`` it counts the call, and the seconds it took, under ``kind`` (the bytes are
counted by ``P2P`` as they are sent); nested collectives (an all_reduce built from reduce_scatter
+ all_gather) pass straight through, so each outermost call counts once. With ``comm.check``
every member sends every other one a header -- call number, kind, numel, dtype, op, src,
algorithm and a checksum of explicit bounds, each an int64 code, plus how many payload bytes
follow it -- so ranks whose calls differ all raise the same ``CollectiveMismatchError``
describing each rank's call, instead of gloo aborting the process, a wait that never ends, or a
silently truncated message.

The header rides in the payload's messages (``Gate``), not in a round of its own: the first
message a rank sends each peer in the collective is the header, followed in the same message by
the payload when it is at most INLINE_BYTES (every small collective: one message per peer, one
wait). Why this shape, measured on gloo (torch 2.13): a message longer than the receive posted
for it aborts the receiving process (``op.preamble.length <= op.nbytes``), a shorter one
silently fills part of it, and a message travels only once its receive is posted (a send whose
receive is never posted does no harm). So the receiver can never post a payload receive sized by
its own expectation before it knows the sender's call. Hence: every header receive is posted with
the fixed capacity header + INLINE_BYTES (no sender ever sends more in a first message); every
other message posted before the check is held back, unposted, until all headers arrived and
matched (at the collective's first wait); larger payloads travel after the check, still without a
round of their own on the sender's side. A mismatch therefore raises before any payload is
used, and leaves nothing posted: the group stays usable. The headers go to every member, not
only to the algorithm's peers, so a mismatch of patterns (a broadcast against an all_reduce)
is caught instead of deadlocking. Batched groups (NCCL) keep the header in a round of its own, and
so do torch's own collectives (``native``): they post no message of ours to ride in.
"""

from __future__ import annotations

import contextlib
import time
import zlib

import torch
from torch import Tensor

from distlib.comm import tally
from distlib.comm.algorithms.reads import meet
from distlib.comm.group import KINDS, Comm
from distlib.comm.header_codes import ALGOS, DTYPES, OPS, code, mismatch
from distlib.comm.p2p import GATE, P2P, CollectiveMismatchError, Done, Message


def check_header(comm: Comm, kind: str, header: list[int]) -> None:
    """The header in a round of its own (used where messages are batched, i.e. NCCL): exchange it
    with every member, then raise on every rank if any member's differs."""
    p2p, me = P2P(f"{kind} (header check)", comm), comm.rank
    mine = torch.tensor(header + [0], dtype=torch.int64, device="cpu")
    parts = [mine if j == me else torch.empty_like(mine) for j in range(comm.size)]
    handles = [p2p.recv(parts[j], j) for j in range(comm.size) if j != me]
    handles += [p2p.send(mine, j) for j in range(comm.size) if j != me]
    p2p.wait(*handles)
    mismatch(comm, kind, [p.tolist()[:-1] for p in parts])


class Gate:
    """The header of one checked outermost collective, riding in its first message to each peer.

    Until every member's header has arrived and matched (``settle``, at the first wait), the
    messages the algorithm posts go through ``post``: the first one to each peer carries the
    header (and the payload itself when it is at most INLINE_BYTES), the first receive from each
    peer is a header receive of the fixed capacity, and every other message waits here, unposted.
    So a payload only travels once both ends know the calls match, and a mismatch leaves nothing
    posted behind it: the group stays usable, as with a round of its own."""

    def __init__(self, comm: Comm, kind: str, header: list[int]):
        self.comm, self.kind, self.header = comm, kind, header
        self.p2p = P2P(f"{kind} (header check)", comm)
        self.sent: dict[int, object] = {}  # peer -> our header message to it
        self.got: dict[int, Tensor] = {}  # peer -> its header message's buffer
        self.arriving: dict[int, object] = {}  # peer -> the receive of that message
        self.first: dict[int, object] = {}  # peer -> our first receive from it (maybe inlined)
        self.stash: dict[int, Tensor] = {}  # peer -> inlined bytes no receive has asked for yet
        self.deferred: list = []  # messages posted before the check, in order
        self.settled = False

    def _header_to(self, peer: int, payload: Tensor | None) -> None:
        inline = 0 if payload is None else payload.numel() * payload.element_size()
        wire = torch.empty(HEADER_BYTES + inline, dtype=torch.uint8, device="cpu")
        wire[:HEADER_BYTES].view(torch.int64).copy_(
            torch.tensor(self.header + [inline], dtype=torch.int64, device=wire.device)
        )
        if inline:
            wire[HEADER_BYTES:].copy_(_bytes(payload))
        stats = self.comm.stats
        if stats is not None:
            stats.bytes_sent[stats.current] += HEADER_BYTES
        self.sent[peer] = self.p2p.start(_raw(torch.distributed.isend, wire, peer, "sending to"))

    def _header_from(self, peer: int) -> None:
        self.got[peer] = torch.empty(HEADER_BYTES + INLINE_BYTES, dtype=torch.uint8, device="cpu")
        self.arriving[peer] = self.p2p.start(
            _raw(torch.distributed.irecv, self.got[peer], peer, "waiting on")
        )

    def post(self, p2p: P2P, message) -> None:
        """A message the algorithm posts (P2P hands over every one while this gate is open)."""
        peer, sending = message.peer, message.fn is torch.distributed.isend
        if self.settled:
            if not sending and peer in self.stash:  # its bytes came with the header
                _serve(message, self.stash.pop(peer))
            else:
                p2p.start(message)
            return
        if sending and peer not in self.sent:
            small = message.tensor.numel() * message.tensor.element_size() <= INLINE_BYTES
            self._header_to(peer, message.wire if small else None)
            if small:
                message.work = Done()
                return
        elif not sending and peer not in self.got:
            self._header_from(peer)
            self.first[peer] = message
        self.deferred.append((p2p, message))

    def settle(self) -> None:
        """Send and receive the headers not sent yet, check every member's, then post what waited."""
        if self.settled:
            return
        self.settled = True
        me, n = self.comm.rank, self.comm.size
        for j in range(n):
            if j != me and j not in self.sent:
                self._header_to(j, None)
            if j != me and j not in self.got:
                self._header_from(j)
        self.p2p.wait(*self.arriving.values())
        words = {j: self.got[j][:HEADER_BYTES].view(torch.int64).tolist() for j in range(n) if j != me}
        try:
            mismatch(self.comm, self.kind, [self.header if j == me else words[j][:-1] for j in range(n)])
        except CollectiveMismatchError:
            self.p2p.wait(*self.sent.values())  # every member receives its headers, then raises
            raise
        for j, w in words.items():
            if w[-1]:
                self.stash[j] = self.got[j][HEADER_BYTES : HEADER_BYTES + w[-1]]
        for p2p, message in self.deferred:
            if message is self.first.get(message.peer) and message.peer in self.stash:
                _serve(message, self.stash.pop(message.peer))
            else:
                p2p.start(message)
        self.deferred = []

    def close(self) -> None:
        """At the end of the collective: every header is on its way, and every inlined payload was used."""
        self.settle()
        # This collective's header sends are not waited on here: a peer that read our header inlined
        # in its own first message may post its receive of ours only at its first wait, and waiting
        # for that would put back the round the header left (measured: 2 waits per collective
        # instead of 1). They are kept alive until the group's next checked collective closes, and
        # waited on then, when they are sure to be done: every peer sent a header for that one, so
        # it had finished this one, whose settle received ours. Those waits return at once, so
        # they are not P2P.wait (benchmarks/rounds.py counts those). gloo's is_completed() of a send
        # stays False until it is waited on: a list pruned by asking it grew by one entry per peer
        # per collective, for the life of the process, and was scanned at every close (30% of a
        # rank's Python time after 20 steps).
        group = self.comm.group if self.comm.group is not None else torch.distributed.group.WORLD
        _wait_all(_UNWAITED.pop(group, []))
        _UNWAITED[group] = list(self.sent.values())
        if self.stash:
            raise CollectiveMismatchError(
                f"{self.kind}: peers {sorted(self.stash)} sent a payload with the header "
                f"that this rank never received",
                self.kind,
            )


# Per process group: the header sends of its last checked collective, not yet waited on (see
# Gate.close).
_UNWAITED: dict = {}


def _wait_all(sends) -> None:
    for message in sends:
        message.work.wait()


def deliver_sent() -> None:
    """Wait until every header send this process holds has been received: call before a process
    that took part in checked collectives leaves while its peers are alive (the run ended, or
    every rank agreed on an error). A send travels only once its receiver posts the receive, which
    every peer does in the same collective; a process that left before could leave a peer still
    waiting on its header with "connection reset" instead of the end of the run."""
    for sends in _UNWAITED.values():
        _wait_all(sends)
    _UNWAITED.clear()


def forget_sent() -> None:
    """Drop the header sends this process holds without waiting on them: their groups are broken
    (a peer was lost) and left for new ones, so no receive will ever be posted for them."""
    _UNWAITED.clear()


def unwaited_sends() -> int:
    """How many header sends this process holds, not yet waited on: at most one collective's per group."""
    return sum(len(sends) for sends in _UNWAITED.values())


HEADER_WORDS = 9  # call, kind, numel, dtype, op, src, algo, bounds, inlined bytes
HEADER_BYTES = 8 * HEADER_WORDS
# A first message whose payload is at most this many bytes carries it after the header; a receiver
# posts every header receive with this capacity (a shorter message fills part of it; a longer one
# would abort the process in gloo, so none is ever sent). Larger payloads follow the header.
INLINE_BYTES = 64 << 10


def _bytes(t: Tensor) -> Tensor:
    return t.reshape(-1).view(torch.uint8)


def _raw(fn, wire: Tensor, peer: int, what: str) -> Message:
    return Message(fn, wire, wire, peer, what)


def _serve(message, data: Tensor) -> None:
    """Complete a receive from bytes that came with the header; sizes agree as the headers did."""
    target = _bytes(message.tensor)
    if target.numel() != data.numel():
        raise CollectiveMismatchError(
            f"first message from group rank {message.peer}: {data.numel()} bytes came "
            f"with the header, {target.numel()} expected",
            "header",
        )
    target.copy_(data)
    message.wire, message.work = message.tensor, Done()


@contextlib.contextmanager
def collective(
    comm: Comm,
    kind: str,
    *,
    numel: int = -1,
    dtype: torch.dtype | None = None,
    op: str | None = None,
    src: int = -1,
    algo: str | None = None,
    bounds: list[tuple[int, int]] | None = None,
):
    """Count (comm.stats) and check (comm.check) the outermost collective; nested ones pass through.
    Explicit uneven ``bounds`` are part of the call (a checksum of them), so ranks that split a
    buffer differently fail here instead of truncating a message or waiting forever."""
    stats = comm.stats
    gate = GATE.get()
    if (stats is not None and stats.depth) or (gate is not None and gate.comm is comm):
        if stats is not None:
            stats.depth += 1
        try:
            yield
        finally:
            if stats is not None:
                stats.depth -= 1
        return
    kind = kind if kind in KINDS else "other"
    if comm.dry and kind != "all_to_all":  # (all_to_all notes its own: its size is per rank)
        tally.note(comm, kind, numel * dtype.itemsize if numel >= 0 and dtype is not None else 0)
    began = time.perf_counter()
    if stats is not None:
        stats.depth, stats.current = 1, kind
    # Under torch.profiler each outermost collective is a named range (train.profile_steps); the
    # check when none collects is one C call (~0.1 us).
    named = (
        torch.profiler.record_function(range_name(kind, algo, numel, dtype))
        if torch.autograd._profiler_enabled()
        else contextlib.nullcontext()
    )
    token = gate = None
    board = getattr(comm.transport, "board", None) if not comm.dry else None
    try:
        with named:
            if comm.check and comm.size > 1:
                call = stats.total_calls if stats is not None else -1
                header = [
                    call,
                    KINDS.index(kind),
                    numel,
                    code(dtype, DTYPES),
                    code(op, OPS),
                    src,
                    code(algo, ALGOS),
                    -1 if bounds is None else zlib.crc32(repr(bounds).encode()),
                ]
                if comm.batched or comm.collectives == "torch":
                    check_header(comm, kind, header)
                elif board is not None:  # published at the algorithm's first barrier
                    board.expect(header, lambda headers: mismatch(comm, kind, headers))
                    if stats is not None:
                        stats.bytes_sent[kind] += 8 * len(header)  # written once, read by all
                else:
                    gate = Gate(comm, kind, header)
                    token = GATE.set(gate)
            yield
            if gate is not None:
                gate.close()
            if board is not None and board.expected is not None:
                _board_round(board, comm, kind)  # the algorithm met nowhere: check on our own
    finally:
        if board is not None:
            board.expected = None
        if token is not None:
            GATE.reset(token)
        if stats is not None:
            stats.depth, stats.current = 0, "other"
            stats.calls[kind] += 1
            stats.seconds[kind] += time.perf_counter() - began


def _board_round(board, comm: Comm, kind: str) -> None:
    """A round of the board with nothing but the header: its barrier checks it."""
    meet(board, board.begin(), f"{kind} (header check)", comm)


RANGE_PREFIX = "collective:"


def range_name(kind: str, algo: str | None, numel: int, dtype: torch.dtype | None) -> str:
    """The profiler range of one collective: ``collective:<kind> algo=<algorithm> bytes=<payload>``
    (the payload is numel x element size; omitted where the call does not say)."""
    name = f"{RANGE_PREFIX}{kind} algo={algo or 'default'}"
    if numel >= 0 and dtype is not None:
        name += f" bytes={numel * dtype.itemsize}"
    return name
