"""Checkpoint save/load throughput: distlib.checkpoint vs raw disk writes vs torch.distributed.checkpoint.

    .venv/bin/python benchmarks/checkpoint.py                    # 50M parameters over 4 ranks
    .venv/bin/python benchmarks/checkpoint.py --params 10e6 --world-size 2 --repeats 1

The state is what a ZeRO checkpoint holds: fp32 master weights, Adam exp_avg and exp_avg_sq for P
parameters (12P bytes), partitioned over N ranks. In one run, on the same disk and the same bytes:

  raw write    every rank writes its 12P/N bytes to one file and fsyncs: the disk's ceiling
  distlib      checkpoint.save (safetensors + sha256 + fsync + manifest + atomic rename) and
               load = verify (every size and sha256) + read this rank's shard
  torch DCP    torch.distributed.checkpoint.save / load of the same tensors (no checksums)
  async        distlib's checkpoint.async_save path (copy into the StagingBuffers kept across saves, as
               Checkpointer.start_save does, open_save, write_own_shard in a BackgroundWrite thread;
               once every rank's write is done -- a barrier stands for the step boundary's decide --
               complete_save commits) and torch.distributed.checkpoint.async_save, as its default
               (thread, a new blocking CPU stager per call: fresh host memory) and with one
               DefaultStager kept across the calls (its storage cache reuses the host memory).
               "blocking" is what a training loop would wait for: ours = the copy + open + the
               commit; DCP's = until async_save returns. "total" runs until the checkpoint is
               complete on every rank. Blocking times are the slowest rank's.

A timing is the slowest rank's (ranks line up on a barrier first); the best of --repeats is kept
(the first round also pays for first-touch page allocation).
Before each load the files are dropped from the page cache (posix_fadvise DONTNEED), so loads
read the disk (on a VM whose disk the host caches, "disk" speeds can exceed the hardware's).
MB/s = 12P bytes / seconds. JSON: benchmarks/results/checkpoint.json (--out).
Temporary files live under --dir (default: the system temp dir) and are removed as we go.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from multiproc import run_ranks
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.background import BackgroundWrite
from distlib.checkpoint.staging import StagingBuffers
from distlib.parallel.adamw import STATE_KEYS
from distlib.parallel.flat_layout import FlatLayout


def _timed(fn) -> float:
    dist.barrier()
    began = time.perf_counter()
    fn()
    dist.barrier()  # the slowest rank decides
    return time.perf_counter() - began


def _drop_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _raw_write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for t in tensors.values():
            f.write(memoryview(t.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def _max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _ours_async(comm, dest: Path, tensors: dict, meta: dict, staging: StagingBuffers) -> tuple[float, float]:
    """(blocking, total) of one distlib async save, as Checkpointer.start_save / settle run it
    (``staging``: kept across the saves, as the Checkpointer keeps it)."""
    dist.barrier()
    began = time.perf_counter()
    staged = staging.stage(tensors)  # Checkpointer.state's copy into the reused buffers
    final = checkpoint.open_save(dest, 1, comm)

    def write() -> dict:
        staging.wait_copied()
        return checkpoint.write_own_shard(final, comm.rank, staged, {"step": 1})

    writer = BackgroundWrite(write)
    staging.lend(writer.done)
    returned = time.perf_counter()  # the loop goes on from here
    while not writer.done():  # (training would run steps meanwhile)
        time.sleep(0.001)
    dist.barrier()  # the boundary's decide: every rank's write is done
    commit_began = time.perf_counter()
    checkpoint.complete_save(final, 1, meta, writer.result, comm)
    blocking = returned - began + time.perf_counter() - commit_began
    dist.barrier()
    return _max_over_ranks(blocking), time.perf_counter() - began


def _dcp_async(state: dict, dest: Path, stager: DefaultStager | None = None) -> tuple[float, float]:
    """(blocking, total) of one torch.distributed.checkpoint.async_save (it returns a Future)."""
    dist.barrier()
    began = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(dest), async_stager=stager)
    blocking = time.perf_counter() - began
    future.result()
    dist.barrier()
    return _max_over_ranks(blocking), time.perf_counter() - began


def _bench_rank(comm, numel: int, repeats: int, workdir: str) -> dict:
    torch.manual_seed(comm.rank)
    # One flat parameter of ``numel`` elements: a manifest that passes the checks every read applies.
    holder = torch.nn.Module()
    holder.flat = torch.nn.Parameter(torch.empty(numel, device="meta"))
    layout = FlatLayout.of(holder, comm.size)
    tensors = {key: torch.randn(layout.shard_numel) for key in STATE_KEYS}
    meta = {"zero_stage": 1, "model": {}, "layout": layout.to_dict()}
    work = Path(workdir)
    rank0 = comm.rank == 0
    best: dict[str, float] = {}
    staging = StagingBuffers()  # ours, kept across the saves as Checkpointer keeps it
    stager = DefaultStager(StagingOptions(False, False, False, False))  # DCP's, kept across its saves

    def keep(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, float("inf")), seconds)

    raw = work / f"raw{comm.rank}.bin"

    def raw_write() -> None:
        keep("raw write", _timed(lambda: _raw_write(raw, tensors)))
        raw.unlink()

    for attempt in range(repeats):
        raw_write()

        ours = work / f"ours{attempt}"
        keep("distlib save", _timed(lambda: checkpoint.save(ours, 1, tensors, {"step": 1}, meta, comm)))
        ckpt = ours / checkpoint.step_dir_name(1)
        if rank0:
            _drop_cache(ckpt)
        # As Trainer.load: the ranks hash the files between them, then each reads its own shard.
        keep("distlib verify", _timed(lambda: checkpoint.verify_collectively(ckpt, comm)))
        if rank0:
            _drop_cache(ckpt)
        loaded = {}
        keep("distlib read", _timed(lambda: loaded.update(checkpoint.load_shard(ckpt, comm.rank)[0])))
        assert all(torch.equal(loaded[k], tensors[k]) for k in STATE_KEYS)
        dist.barrier()
        if rank0:
            shutil.rmtree(ours)

        theirs = work / f"dcp{attempt}"
        state = {f"rank{comm.rank}.{k}": v for k, v in tensors.items()}
        keep("torch DCP save", _timed(lambda: dcp.save(state, checkpoint_id=str(theirs))))
        if rank0:
            _drop_cache(theirs)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        keep("torch DCP load", _timed(lambda: dcp.load(target, checkpoint_id=str(theirs))))
        assert all(torch.equal(target[k], state[k]) for k in state)
        dist.barrier()
        if rank0:
            shutil.rmtree(theirs)

        ours_async = work / f"ours_async{attempt}"
        blocking, total = _ours_async(comm, ours_async, tensors, meta, staging)
        keep("distlib async blocking", blocking)
        keep("distlib async total", total)
        dist.barrier()
        if rank0:
            checkpoint.verify(ours_async / checkpoint.step_dir_name(1))  # it committed, and it verifies
            shutil.rmtree(ours_async)

        theirs_async = work / f"dcp_async{attempt}"
        blocking, total = _dcp_async(state, theirs_async)
        keep("torch DCP async blocking", blocking)
        keep("torch DCP async total", total)
        dist.barrier()
        if rank0:
            shutil.rmtree(theirs_async)
        blocking, total = _dcp_async(state, theirs_async, stager)
        keep("DCP async kept stager blocking", blocking)
        keep("DCP async kept stager total", total)
        dist.barrier()
        if rank0:
            shutil.rmtree(theirs_async)
        raw_write()  # once more after the others, so its best is not at a disadvantage of order
    stager.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=50e6, help="parameters P (state = 12P bytes)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dir", default=None, help="where the temporary checkpoints go (default: system temp)"
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "checkpoint.json"))
    args = parser.parse_args()
    numel = int(args.params)
    state_bytes = 12 * numel
    free = shutil.disk_usage(args.dir or tempfile.gettempdir()).free
    if free < 3 * state_bytes:
        sys.exit(
            f"error: need about {3 * state_bytes / 1e9:.1f} GB free in {args.dir or tempfile.gettempdir()}, "
            f"have {free / 1e9:.1f} GB"
        )
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=args.dir) as workdir:
        began = time.perf_counter()
        per_rank = run_ranks(_bench_rank, args.world_size, numel, args.repeats, workdir, timeout_s=600)
        wall = time.perf_counter() - began
    seconds = per_rank[0]  # every rank timed the same barrier-to-barrier spans
    seconds["distlib load"] = seconds["distlib verify"] + seconds["distlib read"]
    raw = seconds["raw write"]
    rows = []
    print(
        f"checkpoint throughput: P = {numel / 1e6:.1f}M parameters, state = {state_bytes / 1e6:.0f} MB "
        f"(fp32 master + exp_avg + exp_avg_sq) over {args.world_size} rank(s), best of {args.repeats}"
    )
    print(f"{'what':<30}  {'seconds':>8}  {'MB/s':>8}  {'vs raw write':>12}  how")
    for name, note in (
        ("raw write", "12P/N bytes per rank + fsync"),
        ("distlib save", "safetensors + sha256 + fsync + commit"),
        ("torch DCP save", "no checksums"),
        ("distlib async blocking", "what the loop waits: copy + open + commit"),
        ("distlib async total", "until committed"),
        ("torch DCP async blocking", "until async_save returns (staging)"),
        ("torch DCP async total", "until the future is done"),
        ("DCP async kept stager blocking", "one DefaultStager across saves (cached)"),
        ("DCP async kept stager total", "until the future is done"),
        ("distlib load", "verify + read"),
        ("distlib verify", "sizes + sha256 of every file, split over ranks"),
        ("distlib read", "each rank reads its shard"),
        ("torch DCP load", "no verification"),
    ):
        t = seconds[name]
        rows.append(
            {
                "what": name,
                "note": note,
                "seconds": t,
                "mb_per_s": state_bytes / t / 1e6,
                "raw_write_ratio": raw / t,
            }
        )
        print(f"{name:<30}  {t:>8.3f}  {state_bytes / t / 1e6:>8.0f}  {raw / t:>12.2f}  {note}")
    print(
        f"save: distlib / torch DCP time = {seconds['distlib save'] / seconds['torch DCP save']:.2f}; "
        f"load: {seconds['distlib load'] / seconds['torch DCP load']:.2f}  (wall {wall:.0f} s)"
    )
    blocking_ratio = seconds["distlib async blocking"] / seconds["torch DCP async blocking"]
    kept_ratio = seconds["distlib async blocking"] / seconds["DCP async kept stager blocking"]
    print(
        f"async save blocking: distlib / torch DCP async_save = {blocking_ratio:.2f} "
        f"(goal: below 1); total: {seconds['distlib async total'] / seconds['torch DCP async total']:.2f}; "
        f"blocking vs DCP with a kept stager: {kept_ratio:.2f}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "params": numel,
        "state_bytes": state_bytes,
        "world_size": args.world_size,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "rows": rows,
        "async_blocking_vs_dcp_async": blocking_ratio,
        "async_blocking_vs_dcp_async_kept_stager": kept_ratio,
        "wall_s": wall,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
