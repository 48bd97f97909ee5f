"""checkpoint.memory_every_steps=K: every K steps each rank's shard goes to host shared memory
(``distlib.checkpoint.memory_snapshot``), and to a peer rank on another node (``replica``); a
torchrun restart of the job resumes from the newest snapshot every rank can get intact, else
from disk. The Checkpointer calls this component at its three points: resume, each step
boundary, the end of the run (and a rollback).

At a snapshot step every rank writes its own shard (the bytes a disk checkpoint would hold, and
the step's metrics record: ``Checkpointer.snapshot``) and its peer's replica, then one
``agree.all_true`` says whether every rank did: only then are the older snapshots removed, so a
crash in the middle of a round leaves the previous round whole.

Resume (``checkpoint.resume=latest``): the ranks of a node hash the node's snapshots between
them (damaged ones are named on stderr and removed), one ``agree.agreed_all`` gathers what every
rank holds and rank 0's newest committed disk step, and every rank computes the same choice
(``choose``): the newest step for which every rank's snapshot is held somewhere, if it is not
older than the disk checkpoint. A rank whose own snapshot is gone receives it from a rank that
holds it (one round of point-to-point messages), checks its sha256, and restores it.

Cleanup: the end of the run removes the job's directory (node-local rank 0, after every rank
got there); under a launcher (torchrun, or train.py's own) a reaper process started by the first
attempt's local rank 0 removes it when the launcher exits, so a failed job leaves nothing either.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from distlib.app.runtime import launcher_env
from distlib.app.unattended.rollback import RollbackPoint
from distlib.checkpoint import memory_snapshot as shm
from distlib.checkpoint import replica
from distlib.checkpoint import sharded as checkpoint
from distlib.comm import agree
from distlib.comm.group import Comm


def fingerprint(meta: dict, world_size: int) -> str:
    """What a snapshot must match to be restored into this run: the checkpoint manifest's run-wide
    part (model, layout, ZeRO stage, mesh, seed, data config) without the data position, and the
    world size."""
    shape = {k: v for k, v in meta.items() if k not in ("data", "skipped_batches")}
    return hashlib.sha256(json.dumps([world_size, shape], sort_keys=True).encode()).hexdigest()


def choose(reports: list[dict], world_size: int, fingerprint: str) -> tuple[int, dict[int, int]] | None:
    """(step, owner -> the rank that provides it) of the newest snapshot step held for every rank
    (the owner itself when it has its own, else the lowest rank holding a copy), or None when there
    is none or rank 0's newest disk checkpoint (``reports[0]["disk"]``) is newer."""
    holders: dict[int, dict[int, list[int]]] = {}
    for rank, report in enumerate(reports):
        for snap in report["have"]:
            if snap["fingerprint"] == fingerprint:
                holders.setdefault(snap["step"], {}).setdefault(snap["owner"], []).append(rank)
    complete = [step for step, owners in holders.items() if set(owners) == set(range(world_size))]
    disk = reports[0]["disk"]
    if not complete or (disk is not None and disk > max(complete)):
        return None
    step = max(complete)
    return step, {owner: owner if owner in ranks else min(ranks) for owner, ranks in holders[step].items()}


class MemorySnapshots:
    def __init__(
        self,
        every: int,
        comm: Comm,
        run_dir: Path,
        fingerprint: Callable[[], str],
        say: Callable[[str], None],
    ):
        self.every, self.comm, self.say, self._fingerprint = every, comm, say, fingerprint
        # DISTLIB_SHM_DIR: another tmpfs than /dev/shm (the tests give each simulated node its own)
        self.dir = shm.job_dir(run_dir, Path(os.environ.get("DISTLIB_SHM_DIR", shm.SHM)))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", comm.size))  # ranks per node
        self.local_rank = int(os.environ.get("LOCAL_RANK", comm.rank % self.local_world))
        self.offset = replica.peer_offset(self.local_world, comm.size)
        self.newest: int | None = None
        if every and self.local_rank == 0 and launcher_env.under_agent() and launcher_env.attempt() == 0:
            shm.start_reaper(os.getppid(), self.dir)  # the launcher's exit removes the directory

    @property
    def fingerprint(self) -> str:
        return self._fingerprint()

    # -- saving -----------------------------------------------------------------------
    def after_step(self, step: int, state: Callable[[], tuple[dict, dict]]) -> None:
        """At every K-th step: write this rank's snapshot and its peer's replica (collective)."""
        if not self.every or step % self.every:
            return
        me, fingerprint = self.comm.rank, self.fingerprint
        data = shm.pieces(*state())  # (the optimizer's partition read in place: written before it changes)
        digest = shm.sha256(data)
        own = self._write(step, me, data, fingerprint, digest)
        ok = own is not None
        if self.offset:  # (a replica's manifest holds its owner's digest: checked when it is read)
            theirs, their_digest = replica.exchange(data, digest, self.comm, self.offset)
            peer = (me - self.offset) % self.comm.size
            ok = self._write(step, peer, theirs, fingerprint, their_digest) is not None and ok
        if not agree.all_true(ok, self.comm):
            self.say(
                f"memory snapshot of step {step}: not every rank could write it; the previous one "
                f"(step {self.newest}) stays"
            )
            return
        # every rank holds the new round: its older ones go, the last kept to write the next into;
        # and node-local rank 0 removes those no rank of the node holds (a former run's)
        shm.retire_steps(self.dir, step, me)
        if self.local_rank == 0:
            node = range(me - self.local_rank, me - self.local_rank + self.local_world)
            shm.remove_steps(self.dir, lambda s: s == step, leave=node)
        if self.newest is None:
            copies = "its own and a peer's replica" if self.offset else "its own"
            self.say(
                f"memory snapshot: {own.bytes} bytes per rank (rank 0's) in {self.dir}, each rank "
                f"holding {copies}; every {self.every} step(s), the newest kept (and the round"
                " before's files, the next is written into)"
            )
        self.newest = step

    def _write(
        self, step: int, owner: int, data: bytes | list, fingerprint: str, digest: str
    ) -> shm.Snapshot | None:
        try:
            return shm.write(self.dir, step, owner, self.comm.rank, data, fingerprint, digest)
        except OSError as exc:
            print(
                f"warning: rank {self.comm.rank}: memory snapshot of step {step} not written: {exc}",
                file=sys.stderr,
                flush=True,
            )
            return None

    def rolled_back(self, to_step: int) -> None:
        """A rollback: snapshots newer than the state rolled back to are of a rejected update."""
        if self.every:
            shm.remove_steps(
                self.dir, lambda s: s <= to_step, holder=None if self.local_rank == 0 else self.comm.rank
            )
            self.newest = None

    def finish(self) -> None:
        """The end of the run (collective): the job's snapshots are removed."""
        if self.every and agree.all_true(True, self.comm) and self.local_rank == 0:
            shm.clean(self.dir)

    # -- resuming ---------------------------------------------------------------------
    def resume(self, latest: bool, disk_root: Path) -> RollbackPoint | None:
        """The state (in memory) of the newest complete snapshot round, or None: resume from disk.
        A run that does not resume first removes any earlier snapshots."""
        if not self.every:
            return None
        if not latest:
            if self.local_rank == 0:
                shm.clean(self.dir)
            return None
        comm, rank = self.comm, self.comm.rank
        found: list[shm.Snapshot] = []

        def report() -> dict:
            intact, problems = shm.scan(self.dir, share=(self.local_rank, self.local_world))
            for problem in problems:
                print(
                    f"resume: refusing a damaged memory snapshot (removed): {problem}",
                    file=sys.stderr,
                    flush=True,
                )
            found.extend(intact)
            disk = checkpoint.list_committed(disk_root) if rank == 0 else []
            return {
                "have": [s.describe() for s in intact],
                "disk": int(disk[-1].name[len("step_") :]) if disk else None,
            }

        reports = agree.agreed_all(report, comm, checkpoint.CheckpointError)
        plan = choose(reports, comm.size, self.fingerprint)
        if plan is None:
            self.say(
                f"resume: no memory snapshot round newer than the disk checkpoints in {self.dir}; from disk"
            )
            return None
        step, providers = plan
        mine = {s.owner: s for s in found if s.step == step}
        try:
            outgoing = agree.agreed(
                lambda: {o: shm.verify(mine[o]) for o, p in providers.items() if p == rank},
                comm,
                checkpoint.CheckpointError,
            )
            sends = [(owner, data) for owner, data in outgoing.items() if owner != rank]
            source = providers[rank]
            held = next(s for s in reports[source]["have"] if s["step"] == step and s["owner"] == rank)
            received = replica.deliver(sends, None if source == rank else (source, held["bytes"]), comm)
            state = agree.agreed(
                lambda: self._decode(outgoing.get(rank, received), held["sha256"]),
                comm,
                checkpoint.CheckpointError,
            )
        except checkpoint.CheckpointError as exc:
            self.say(f"resume: the memory snapshot of step {step} could not be restored ({exc}); from disk")
            return None
        moved = sorted(o for o, p in providers.items() if p != o)
        self.say(
            f"resume: from the memory snapshot of step {step} in {self.dir}"
            + (f" (rank(s) {moved} from peer replicas)" if moved else "")
        )
        self.newest = step
        return RollbackPoint(step, None, state)

    @staticmethod
    def _decode(data: bytes | None, expected: str) -> tuple[dict, dict]:
        if data is None or shm.sha256(data) != expected:
            raise checkpoint.CheckpointError(
                f"memory snapshot bytes arrived with sha256 "
                f"{None if data is None else shm.sha256(data)}, expected {expected}"
            )
        return shm.decode(data)
