"""The retention rule on its own (distlib/app/checkpointing/retention.py): which committed
checkpoints are deleted, and when, for a table of saves and guard verdicts; and the small API a
rollback reaches the checkpoints through.

Each row drives ``Retention`` over a real directory on one rank: ``s<N>`` a save of step N
committed (pending with the guard on), ``a<N>`` one committed after its next step passed (an async
save), ``p`` the guard passing a step, ``end`` the end of the run, ``trip<T>`` a trip rolled back
to step T. An earlier run's checkpoints may already be in the directory.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from distlib.app.checkpointing.checkpointer import Checkpointer
from distlib.app.checkpointing.retention import Retention, doomed
from distlib.app.unattended.rollback import RollbackPoint, RollbackSource
from distlib.checkpoint import sharded as checkpoint
from distlib.comm.group import Comm

ONE_RANK = Comm(ranks=(0,), rank=0)

# keep_last, guard on, earlier run's steps, events -> steps deleted (in order)
TABLE = [
    (0, False, [], "s2 s4 s6 end", []),  # keep_last=0 keeps everything
    (0, True, [1], "s2 p s4 p s6 p end", []),
    (1, False, [], "s2 s4 s6", [2, 4]),  # guard off: trusted, and pruned, at the commit
    (2, False, [1], "s2 s4", [1]),  # an earlier run's checkpoints count
    (1, True, [], "s2 p s4", []),  # 4 is pending: 2, the newest trusted, stays
    (1, True, [], "s2 p s4 p", [2]),  # 4 trusted: 2 goes
    (1, True, [], "s2 p s4 end", [2]),  # the end trusts the pending one
    (1, True, [], "s2 p a4", [2]),  # committed after its next step passed: trusted at once
    (2, True, [], "s2 p s4 p s6 p s8", [2]),  # 8 pending: 4 and 6 stay
    (3, True, [1, 2, 3, 4], "p p s5", []),  # nothing becomes trusted, nothing is deleted
    (3, True, [1, 2, 3, 4], "p s5 p", [1, 2]),
    (1, True, [], "s2 p s4 trip2 s4 p", [2]),  # the distrusted 4 is set aside, the re-run's 4 kept
]


def _drive(retention: Retention, root: Path, events: str) -> list[int]:
    deleted: list[str] = []
    for event in events.split():
        if event[0] in "sa":
            step = int(event[1:])
            path = root / checkpoint.step_dir_name(step)
            _commit(path)
            deleted += retention.committed(step, path, trusted=event[0] == "a")
        elif event == "p":
            deleted += retention.step_passed()
        elif event == "end":
            deleted += retention.end()
        else:
            targets, distrusted = retention.distrust()
            target = next(t for t in targets if t.step == int(event[len("trip") :]))
            retention.set_aside(target, 1)
    return [int(Path(p).name[len("step_") :]) for p in deleted]


def _commit(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "rank00000.safetensors").write_bytes(b"shard")
    (path / checkpoint.MANIFEST).write_text("{}")


def _on_disk(root: Path) -> list[int]:
    return [int(p.name[len("step_") :]) for p in checkpoint.list_committed(root)]


@pytest.mark.parametrize("keep_last, guarded, earlier, events, deleted", TABLE)
def test_the_rule_deletes_these_checkpoints_at_these_moments(
    tmp_path, keep_last, guarded, earlier, events, deleted
):
    root = tmp_path / "checkpoints"
    for step in earlier:
        _commit(root / checkpoint.step_dir_name(step))
    retention = Retention(keep_last, guarded, root, ONE_RANK)
    if guarded:
        retention.start(RollbackPoint(0, None, ({}, {})))
    saved = [int(e[1:]) for e in events.split() if e[0] in "sa"]
    assert _drive(retention, root, events) == deleted
    left = _on_disk(root)
    assert left == sorted(set(earlier + saved) - set(deleted)), "deleted means gone; nothing else is"
    if keep_last:  # never fewer than keep_last of them
        assert len(left) >= min(keep_last, len(set(earlier + saved)))
    # what the resume check reloads (the first save; with keep_last the newest) is never deleted
    assert retention.resume_check_follows_newest == (keep_last > 0)
    if saved:
        assert (saved[-1] if keep_last else saved[0]) in left


def test_a_trip_distrusts_the_pending_checkpoint_and_sets_the_later_ones_aside(tmp_path):
    root = tmp_path / "checkpoints"
    retention = Retention(1, True, root, ONE_RANK)
    retention.start(RollbackPoint(0, None, ({}, {})))
    _drive(retention, root, "s2 p s4 p s6")
    targets, distrusted = retention.distrust()
    assert [t.step for t in targets] == [4] and distrusted.step == 6  # 2 pruned, the memory state dropped
    moved = retention.set_aside(targets[0], 3)
    assert moved == [str(root / "rolled_back_3" / "step_00000006")] and Path(moved[0]).is_dir()
    assert _on_disk(root) == [4]
    assert retention.step_passed() == [], "a distrusted checkpoint never becomes trusted"


def test_a_rollback_past_a_trusted_checkpoint_forgets_it(tmp_path):
    """The newest trusted checkpoint failed to load, the rollback went to the one before: the newer
    one is moved aside with the rest and is no target any more."""
    root = tmp_path / "checkpoints"
    retention = Retention(0, True, root, ONE_RANK)
    retention.start(RollbackPoint(0, None, ({}, {})))
    _drive(retention, root, "s2 p s4 p s6")
    targets, _ = retention.distrust()
    assert [t.step for t in targets] == [4, 2]
    assert [Path(p).name for p in retention.set_aside(targets[1], 1)] == ["step_00000004", "step_00000006"]
    assert [t.step for t in retention.distrust()[0]] == [2] and _on_disk(root) == [2]


def test_doomed_keeps_the_newest():
    assert doomed([1, 2, 3], 0) == [] and doomed([1, 2, 3], 2) == [1] and doomed([1], 5) == []


ROOT = Path(__file__).resolve().parents[1]
# file -> what it removes with shutil.rmtree instead (a new entry needs a reason: a committed
# checkpoint is deleted only by Retention, through sharded.delete)
REMOVES_NO_COMMITTED_CHECKPOINT = {
    "distlib/checkpoint/sharded.py": "a save's uncommitted .partial directory; and delete() itself",
    "distlib/app/checkpointing/retention.py": "unfinished saves' .partial directories, at the run's end",
    "distlib/checkpoint/memory_snapshot.py": "memory snapshots in /dev/shm",
    "distlib/app/checkpointing/hf_export.py": "an unfinished Hugging Face export directory",
    "distlib/app/data/token_shards.py": "a token cache's failed build or its stale predecessor",
    "distlib/launch/local.py": "the launcher's own agent directory of error files, in the temp dir",
}


def test_committed_checkpoints_are_deleted_only_through_retention():
    found = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "distlib").rglob("*.py"))}
    removers = {p for p, text in found.items() if "rmtree(" in text}
    assert removers == set(REMOVES_NO_COMMITTED_CHECKPOINT), removers
    callers = {p for p, text in found.items() if "checkpoint.delete(" in text or "sharded.delete(" in text}
    assert callers == {"distlib/app/checkpointing/retention.py"}, callers


def test_the_checkpointer_implements_every_call_a_rollback_makes():
    """Rollback reaches the checkpoints only through RollbackSource: the Checkpointer overrides
    each of its methods with the same signature (a missing one would inherit the empty stub)."""
    calls = [n for n, f in vars(RollbackSource).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert sorted(calls) == ["restore", "rolled_back_to", "trusted_targets"]
    for name in calls:
        mine, declared = getattr(Checkpointer, name), getattr(RollbackSource, name)
        assert mine is not declared, f"Checkpointer.{name} missing"
        assert inspect.signature(mine) == inspect.signature(declared), name
