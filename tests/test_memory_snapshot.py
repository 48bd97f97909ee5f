"""In-memory snapshots in /dev/shm hold the disk shard's bytes; a killed or lost rank resumes from its own
or a peer's snapshot exactly, a damaged one falls back to disk, and nothing is left behind after a run."""

from __future__ import annotations

import json
import math
import os
import random
import shutil

import pytest
import torch
from ckpt_util import train, train_rank, tree
from multiproc import run_ranks

from distlib.app.checkpointing.memory_snapshots import choose
from distlib.checkpoint import memory_snapshot as shm
from distlib.checkpoint import replica
from distlib.checkpoint import sharded as checkpoint

STEPS, EVERY = 8, 4  # disk checkpoints at 4 and 8; the kill comes after step 6


def _files(run) -> dict[str, bytes]:
    ckpt = run / "checkpoints" / checkpoint.step_dir_name(STEPS)
    manifest = checkpoint.verify(ckpt)
    return {f["path"]: (ckpt / f["path"]).read_bytes() for f in manifest["files"]}


@pytest.fixture
def job(tmp_path):
    """A run directory; its /dev/shm directory is removed afterwards whatever the test did."""
    run = tmp_path / "run"
    yield run
    shm.clean(shm.job_dir(run))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    """The uninterrupted 2-rank run, snapshots off: the losses and final checkpoint to reproduce."""
    run = tmp_path_factory.mktemp("clean") / "run"
    results = train(tree(2, steps=STEPS, every=EVERY), run)
    return {"losses": results[0]["losses"], "files": _files(run)}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A 2-rank run with snapshots every step whose rank 1 is SIGKILLed after step 6 (run once;
    each test resumes its own copy, see ``_copy_killed``)."""
    run = tmp_path_factory.mktemp("killed") / "run"
    with pytest.raises(AssertionError, match="rank 1"):  # rank 1 died, rank 0 saw it stop
        train(
            tree(
                2,
                steps=STEPS,
                every=EVERY,
                checkpoint={"memory_every_steps": 1},
                fault={"kill_rank": 1, "kill_at_step": 6},
            ),
            run,
        )
    yield run
    shm.clean(shm.job_dir(run))


def _copy_killed(killed, run) -> None:
    """``run`` becomes the killed job as it was left: its run directory and its /dev/shm snapshots
    (the job directory is named by the run directory, the snapshots' fingerprint is not)."""
    shutil.copytree(killed, run)
    shutil.copytree(shm.job_dir(killed), shm.job_dir(run))


def _resume(run, monkeypatch) -> list[dict]:
    """The torchrun restart of the same job: resume=latest, not the first attempt (no second kill)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    return train(
        tree(
            2,
            steps=STEPS,
            every=EVERY,
            checkpoint={"memory_every_steps": 1, "resume": "latest"},
            fault={"kill_rank": 1, "kill_at_step": 6},
        ),
        run,
    )


# -- the format --------------------------------------------------------------------------------------
def test_snapshot_bytes_are_the_disk_shard_bytes(tmp_path):
    tensors = {"master": torch.randn(10), "rng.torch": torch.get_rng_state()}
    rank_state = {"step": 3, "data": {"next_sample": 48}}
    checkpoint.write_shard(tmp_path, 0, tensors, rank_state)
    data = shm.encode(tensors, rank_state)
    assert data == (tmp_path / checkpoint.shard_name(0)).read_bytes()
    back, state = shm.decode(data)
    assert state == rank_state and all(torch.equal(back[k], tensors[k]) for k in tensors)


def _random_shard(rng: random.Random) -> dict[str, torch.Tensor]:
    """0-4 tensors of the dtypes a shard holds (and one ``pieces`` does not lay out itself), of
    every shape: none, empty, one element, a few dimensions; names of any characters; some of them
    a slice inside a larger tensor (as the optimizer's live partition is of its flat buffer)."""
    dtypes = [*shm._DTYPES, torch.complex64]
    tensors = {}
    for _ in range(rng.randrange(5)):
        name = "".join(rng.choice('ab.é_"\\z09 ') for _ in range(rng.randrange(1, 6)))
        shape = [rng.randrange(4) for _ in range(rng.randrange(3))]
        dtype = rng.choice(dtypes)
        drawn = torch.rand([3 + math.prod(shape)], generator=torch.Generator().manual_seed(rng.randrange(99)))
        start = rng.randrange(4)  # (0: at its storage's start)
        tensors[name] = (drawn * 9).to(dtype)[start : start + math.prod(shape)].view(shape)
    return tensors


@pytest.mark.parametrize("seed", range(40))
def test_a_snapshot_in_pieces_is_the_disk_shard_bytes(seed, tmp_path):
    """``pieces`` lays out safetensors' file itself (the tensors read in place): its pieces, joined
    or written, are ``encode``'s bytes, for any tensors, names and state."""
    rng = random.Random(seed)
    tensors = _random_shard(rng)
    rank_state = {"step": seed, "text": "".join(rng.choice('é"\\\n\x01x') for _ in range(rng.randrange(6)))}
    data = shm.encode(tensors, rank_state)
    parts = shm.pieces(tensors, rank_state)
    assert b"".join(parts) == data
    whole, pieced = (
        shm.write(tmp_path / "a", 1, 0, 0, data, "fp"),
        shm.write(tmp_path / "b", 1, 0, 0, parts, "fp"),
    )
    assert (pieced.bytes, pieced.sha256) == (whole.bytes, whole.sha256) == (len(data), shm.sha256(data))
    assert pieced.path.read_bytes() == data


def test_damaged_snapshot_is_refused_by_hash_named_and_removed(tmp_path):
    good = shm.write(tmp_path, 5, 0, 0, b"x" * 100, "fp")
    bad = shm.write(tmp_path, 5, 1, 1, b"y" * 100, "fp")
    raw = bytearray(bad.path.read_bytes())
    raw[50] ^= 1
    bad.path.write_bytes(bytes(raw))
    (tmp_path / "step00000004.rank00000.held00000.safetensors").write_bytes(b"no manifest: never finished")
    intact, problems = shm.scan(tmp_path)
    assert intact == [good]
    assert len(problems) == 1 and str(bad.path) in problems[0] and "sha256" in problems[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [good.path.name, good.path.with_suffix(".json").name]
    )


def test_only_the_newest_step_is_kept(tmp_path):
    for step in (1, 2, 3):
        shm.write(tmp_path, step, 0, 0, b"z" * 10, "fp")
    shm.remove_steps(tmp_path, lambda s: s == 3)
    assert [s.step for s in shm.listing(tmp_path)] == [3]


@pytest.mark.parametrize("sizes", [(100, 100, 100), (100, 40, 250), (250, 40, 30), (64, 0, 64)])
def test_a_retired_snapshot_is_the_file_the_next_one_is_written_into(tmp_path, sizes):
    """``retire_steps``: a holder's snapshots of older steps go from the listing, each owner's
    newest kept as its spare, whose pages (its inode) the next snapshot of that owner is written
    into, truncated to its own bytes, whatever their size; an owner's older ones and another
    holder's are not its spare."""
    data = [bytes([step]) * size for step, size in enumerate(sizes, 1)]
    first = shm.write(tmp_path, 1, 0, 0, data[0], "fp")
    shm.write(tmp_path, 1, 1, 0, b"r" * 30, "fp")  # a replica this rank holds of rank 1
    other = shm.write(tmp_path, 1, 2, 2, b"o" * 30, "fp")  # rank 2's own: not this holder's
    inode = first.path.stat().st_ino
    second = shm.write(tmp_path, 2, 0, 0, [data[1][:10], data[1][10:]], "fp")
    shm.retire_steps(tmp_path, 2, holder=0)
    assert sorted((s.step, s.owner, s.holder) for s in shm.listing(tmp_path)) == [(1, 2, 2), (2, 0, 0)]
    assert other.path.exists() and not first.path.exists()
    assert sorted(p.name for p in tmp_path.glob("*.spare")) == [
        "rank00000.held00000.spare",
        "rank00001.held00000.spare",
    ]
    third = shm.write(tmp_path, 3, 0, 0, data[2], "fp")
    assert third.path.stat().st_ino == inode and not (tmp_path / "rank00000.held00000.spare").exists()
    assert third.path.read_bytes() == data[2] and shm.verify(third) == data[2]
    assert shm.verify(second) == data[1]
    kept = second.path.stat().st_ino
    shm.retire_steps(tmp_path, 3, holder=0)  # step 2's file is now the spare
    assert (tmp_path / "rank00000.held00000.spare").stat().st_ino == kept
    assert [s.step for s in shm.listing(tmp_path) if s.holder == 0] == [3]


def test_a_nodes_sweep_leaves_what_its_ranks_hold(tmp_path):
    """Node-local rank 0 removes older snapshots no rank of its node holds (a former run's); its
    node's ranks retire their own (their spares kept), so it leaves those."""
    for holder in (0, 1, 7):
        shm.write(tmp_path, 1, holder, holder, b"a" * 10, "fp")
    shm.remove_steps(tmp_path, lambda s: s == 2, leave=range(0, 2))
    assert sorted(s.holder for s in shm.listing(tmp_path)) == [0, 1]


def test_job_directory_is_stable_per_run_directory_and_distinct_between_them(tmp_path):
    assert shm.job_dir(tmp_path / "a") == shm.job_dir(tmp_path / "x" / ".." / "a")
    assert shm.job_dir(tmp_path / "a") != shm.job_dir(tmp_path / "b")
    assert shm.job_dir(tmp_path / "a").parent == shm.SHM


# -- the agreed choice -------------------------------------------------------------------------------
def _have(step, owner, fp="fp"):
    return {"step": step, "owner": owner, "bytes": 1, "sha256": "s", "fingerprint": fp}


def test_choose_newest_complete_round_and_its_providers():
    reports = [
        {"have": [_have(6, 0), _have(6, 1), _have(5, 0)], "disk": 4},
        {"have": [_have(5, 1)], "disk": None},
    ]
    # step 6: rank 1's own copy is gone, rank 0 holds its replica
    assert choose(reports, 2, "fp") == (6, {0: 0, 1: 0})
    reports[0]["have"] = [_have(6, 0), _have(5, 0)]  # nobody holds rank 1's step 6: step 5
    assert choose(reports, 2, "fp") == (5, {0: 0, 1: 1})
    reports[0]["disk"] = 6  # a newer disk checkpoint wins
    assert choose(reports, 2, "fp") is None
    reports[0]["disk"] = None
    assert choose(reports, 2, "another run's shape") is None


# -- training with snapshots -------------------------------------------------------------------------
def test_snapshots_change_no_loss_and_leave_nothing_after_a_finished_run(job, clean):
    results = train(tree(2, steps=STEPS, every=EVERY, checkpoint={"memory_every_steps": 1}), job)
    assert results[0]["losses"] == clean["losses"]  # the exact floats (loss_hex)
    assert _files(job) == clean["files"]
    assert not shm.job_dir(job).exists()


@pytest.mark.slow
def test_sigkill_resumes_from_the_snapshot_of_the_step_it_died_after(job, clean, killed, monkeypatch, capfd):
    _copy_killed(killed, job)
    snaps = shm.listing(shm.job_dir(job))
    assert sorted((s.step, s.owner) for s in snaps) == [(6, 0), (6, 1)]  # only the newest kept
    resumed = _resume(job, monkeypatch)
    assert [r["start"] for r in resumed] == [6, 6]  # no step lost (disk alone: step 4)
    assert resumed[0]["losses"] == {s: v for s, v in clean["losses"].items() if s > 6}
    assert _files(job) == clean["files"]
    assert "resume: from the memory snapshot of step 6" in capfd.readouterr().out
    assert not shm.job_dir(job).exists()


def _step_records(metrics) -> list[dict]:
    """The step records of a metrics file whose one line cut short by a kill stands alone."""
    lines = metrics.read_text().splitlines()
    assert lines.count('{"type": "st') == 1
    return [r for r in map(json.loads, (x for x in lines if x != '{"type": "st')) if r["type"] == "step"]


@pytest.mark.slow
def test_a_step_in_its_snapshot_but_not_in_the_metrics_is_recorded_on_resume(job, killed, monkeypatch):
    """The snapshot round comes before the step's record: a kill between the two leaves a step
    done but unrecorded (made so here by removing step 6's record). The resume writes the record
    rank 0's snapshot holds, the same record, once; a second resume writes it no more."""
    _copy_killed(killed, job)
    metrics = job / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lost = next(line for line in reversed(lines) if '"type": "step"' in line)
    assert json.loads(lost)["step"] == 6
    metrics.write_text("".join(line + "\n" for line in lines if line != lost) + '{"type": "st')  # cut short
    _resume(job, monkeypatch)
    records = _step_records(metrics)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[5] == json.loads(lost)


@pytest.mark.slow
@pytest.mark.parametrize("harm", ["damaged", "missing"])
def test_a_damaged_or_missing_snapshot_falls_back_to_disk_exactly(
    job, clean, killed, monkeypatch, capfd, harm
):
    _copy_killed(killed, job)
    snap = next(s for s in shm.listing(shm.job_dir(job)) if s.owner == 1)
    if harm == "damaged":
        raw = bytearray(snap.path.read_bytes())
        raw[-1] ^= 0xFF
        snap.path.write_bytes(bytes(raw))
    else:
        shm.remove(snap)
    resumed = _resume(job, monkeypatch)
    assert [r["start"] for r in resumed] == [4, 4]  # the step-4 disk checkpoint
    assert resumed[0]["losses"] == {s: v for s, v in clean["losses"].items() if s > 4}
    assert _files(job) == clean["files"]
    err = capfd.readouterr().err
    assert (f"refusing a damaged memory snapshot (removed): memory snapshot {snap.path}" in err) == (
        harm == "damaged"
    )


def _on_own_node(comm, config: dict, run_dir: str, memory: str) -> dict:
    """A rank whose node has its own shared memory (DISTLIB_SHM_DIR=<memory>/node<rank>)."""
    os.environ["DISTLIB_SHM_DIR"] = f"{memory}/node{comm.rank}"
    return train_rank(comm, config, run_dir)


def _garbled_in_transit(comm, config: dict, run_dir: str, memory: str) -> dict:
    """``_on_own_node``, where the replica bytes this rank receives at a restore lose one bit on
    the way (after the holder checked its file, before the receiver checks what came)."""
    delivered = replica.deliver

    def garbled(sends, receive, group):
        data = delivered(sends, receive, group)
        return None if data is None else data[:-1] + bytes([data[-1] ^ 1])  # a tensor's last byte

    replica.deliver = garbled  # this forked rank's only
    return _on_own_node(comm, config, run_dir, memory)


def _garbled_when_replicated(comm, config: dict, run_dir: str, memory: str) -> dict:
    """``_on_own_node``, where the replica bytes this rank receives at every snapshot lose one bit on
    the way (the owner's sha256 beside them intact)."""
    exchanged = replica.exchange

    def garbled(pieces, digest, group, offset):
        data, theirs = exchanged(pieces, digest, group, offset)
        data[-1] ^= 1  # a tensor's last byte
        return data, theirs

    replica.exchange = garbled  # this forked rank's only
    return _on_own_node(comm, config, run_dir, memory)


@pytest.mark.slow
@pytest.mark.parametrize("transit", ["intact", "garbled", "garbled when replicated"])
def test_a_lost_node_recovers_from_the_peer_replicas(job, clean, monkeypatch, capfd, tmp_path, transit):
    # One rank per "node" (LOCAL_WORLD_SIZE=1), each node its own memory: rank r's replica is held
    # by rank r+1 mod 2, on the other node. Garbled on its way back, the replica is refused by the
    # receiver's sha256 check, nothing is loaded from it, and the run resumes from disk; garbled on
    # its way to its holder, it is refused by the holder's check of its file against the owner's
    # sha256, and the run resumes from disk.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    memory = tmp_path / "shm"
    config = tree(
        2,
        steps=STEPS,
        every=EVERY,
        checkpoint={"memory_every_steps": 1},
        fault={"kill_rank": 1, "kill_at_step": 6},
    )
    first = _garbled_when_replicated if transit == "garbled when replicated" else _on_own_node
    with pytest.raises(AssertionError, match="rank 1"):
        run_ranks(first, 2, config, str(job), str(memory), timeout_s=60)
    nodes = [shm.job_dir(job, memory / f"node{n}") for n in range(2)]
    assert [sorted((s.owner, s.holder) for s in shm.listing(d)) for d in nodes] == [
        [(0, 0), (1, 0)],
        [(0, 1), (1, 1)],
    ]
    shm.clean(nodes[1])  # node 1 lost its memory
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    config["checkpoint"]["resume"] = "latest"
    rank = _garbled_in_transit if transit == "garbled" else _on_own_node
    held = next(s for s in shm.listing(nodes[0]) if s.owner == 1)
    resumed = run_ranks(rank, 2, config, str(job), str(memory), timeout_s=60)
    captured = capfd.readouterr()
    out = captured.out
    if transit == "intact":
        assert [r["start"] for r in resumed] == [6, 6]  # rank 1's state came from node 0
        assert "(rank(s) [1] from peer replicas)" in out
    elif transit == "garbled when replicated":
        assert [r["start"] for r in resumed] == [4, 4]
        refused = f"resume: refusing a damaged memory snapshot (removed): memory snapshot {held.path}: sha256"
        assert refused in captured.err and "resume: no memory snapshot round newer" in out
        assert resumed[0]["losses"] == {s: v for s, v in clean["losses"].items() if s > 4}
    else:
        assert [r["start"] for r in resumed] == [4, 4]  # the disk checkpoint of step 4
        assert "resume: the memory snapshot of step 6 could not be restored (memory snapshot bytes " in out
        assert "; from disk" in out and "from peer replicas" not in out
        assert resumed[0]["losses"] == {s: v for s, v in clean["losses"].items() if s > 4}
    assert _files(job) == clean["files"]
    assert not nodes[0].exists() and not nodes[1].exists()


def test_memory_every_steps_is_validated():
    from distlib.app.config.run import ConfigError, RunConfig

    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="checkpoint.memory_every_steps must be an integer >= 0"):
            RunConfig.from_dict({"checkpoint": {"memory_every_steps": bad}})
    assert RunConfig.from_dict({}).checkpoint.memory_every_steps == 0
