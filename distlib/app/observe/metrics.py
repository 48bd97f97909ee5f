"""Per-step metrics as JSON lines, events, and the rank-0 progress line.

Rank 0 writes ``<run dir>/<metrics.file>``: one ``"type": "step"`` record per step
(collective traffic counted from the step's start to its record, the stretch
step_time_s measures: per kind over all of a rank's groups, and as ``comm_bytes``
the bytes rank 0 really sent on each named sub-group, e.g. data- and tensor-parallel) and
``"type": "event"`` records (run start/restart, checkpoint saved, rollback, pre-emption, desync,
errors, run end). Values that live on every rank (memory,
collective traffic, step time) reach rank 0 through one gather per step (the trainer's,
which carries the step's other per-rank values too: ``row`` is this rank's part) and are
logged as max and mean over ranks. With ``metrics.per_rank`` every rank also writes
its own values to ``metrics.rank<R>.jsonl``. Each step record also names the slowest rank (the
busiest outside collectives) and its lag over the median (``stragglers``; a persistent
one gets a ``straggler`` event), and the model FLOPs utilisation against the peak measured at start
(``throughput``). The schema is in docs/unattended.md.
The file is only ever appended to: after a rollback the re-run steps are logged
again, so a step's final record is the last one with its step number. With
``metrics.tensorboard`` rank 0 also writes each step record's scalars as TensorBoard
events (``tensorboard``).
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from distlib.app.config.groups import MetricsConfig
from distlib.app.config.operation import GuardConfig
from distlib.app.observe import records
from distlib.app.observe.stragglers import StragglerWatch, slowest
from distlib.app.observe.throughput import mfu
from distlib.comm import agree
from distlib.comm.group import KINDS, Comm

MEMORY_KEYS = (
    "params_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "peak_rss_bytes",
    "activation_bytes",
    "step_peak_bytes",  # metrics.step_peak only (NaN in the row, left out of the records otherwise)
)
SECONDS = len(MEMORY_KEYS)  # index of step_time_s in a rank's gathered row; its comm figures follow
ROW_WIDTH = SECONDS + 1 + 3 * len(KINDS)


def _memory_row(memory: dict[str, int]) -> list[float]:
    return [
        float(memory["params"]),
        float(memory["grads"]),
        float(memory["optimizer"]),
        float(peak_rss_bytes()),
        float(memory.get("activations", 0)),
        float(memory.get("step_peak", math.nan)),
    ]


def _memory_fields(values: list[float]) -> dict[str, int]:
    """A rank's memory bytes by key, the figures it did not measure left out."""
    return {k: int(v) for k, v in zip(MEMORY_KEYS, values) if not math.isnan(v)}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports kilobytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def json_number(x: float):
    """JSON has no NaN/inf; log them as strings so a diverged step is still a valid record."""
    return x if math.isfinite(x) else str(x)


def _stats(values: list[float]) -> dict:
    return {"max": max(values), "mean": sum(values) / len(values)}


class MetricsLog:
    def __init__(
        self,
        cfg: MetricsConfig,
        run_dir: Path,
        comm: Comm,
        tokens_per_step: int,
        total_steps: int,
        groups: Mapping[str, Comm] | None = None,
        guard: GuardConfig | None = None,
        model_flops: float = 0.0,
        peak_flops: float = 0.0,
    ):
        """``groups``: the sub-groups of ``comm`` whose traffic ``comm_bytes`` reports by name
        ({"dp": mesh.dp, "tp": mesh.tp}); with a CommStats of their own (comm.mesh gives them
        one), the per-kind figures add theirs to the world's, each counted once. ``model_flops``:
        the model's arithmetic per step, ``peak_flops``: the job's measured peak (for MFU)."""
        self.cfg, self.comm, self.groups = cfg, comm, dict(groups or {})
        self.tokens_per_step, self.total_steps = tokens_per_step, total_steps
        self.run_dir = Path(run_dir)
        if comm.rank == 0 or cfg.per_rank:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.shared = records.appending(self.run_dir / cfg.file) if comm.rank == 0 else None
        self.own = open(self.run_dir / f"metrics.rank{comm.rank}.jsonl", "a") if cfg.per_rank else None
        self._comm_seen = [0.0] * (3 * len(KINDS))
        self._group_seen = dict.fromkeys(self.groups, 0)
        self._memory_logged = False
        self.model_flops, self.peak_flops = model_flops, peak_flops
        guard = guard or GuardConfig()
        self.stragglers = StragglerWatch(guard.straggler_factor, guard.straggler_window)
        self.tensorboard = None
        if cfg.tensorboard and comm.rank == 0:  # imported only then: it brings tensorboard and protobuf
            from distlib.app.observe.tensorboard import TensorBoardLog

            self.tensorboard = TensorBoardLog(self.run_dir)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        for f in (self.shared, self.own, self.tensorboard):
            if f:
                f.close()

    @staticmethod
    def _write(f, record: dict) -> None:
        f.write(json.dumps(record) + "\n")
        f.flush()

    def start_event(self, start: int, resume_path: Path | None, attempt: int, world_size: int, steps: int):
        """The run's first event: ``run_start``, or ``restart`` when it resumed a checkpoint or the
        launcher started it again (``attempt``)."""
        if resume_path is None and not attempt:
            self.event("run_start", start, world_size=world_size, steps=steps)
            return
        self.event(
            "restart",
            start,
            say=f"resumed from {resume_path} (launcher attempt {attempt})",
            checkpoint=str(resume_path) if resume_path else None,
            attempt=attempt,
            world_size=world_size,
            steps=steps,
        )

    def peak_event(self, step: int, source: str) -> None:
        """Which peak MFU is measured against, and where it came from (throughput.job_peak)."""
        say = f"MFU's peak {self.peak_flops:.3g} FLOP/s for the job ({source})"
        self.event("mfu_peak", step, say=say, peak_flops=self.peak_flops, source=source)

    def event(self, name: str, step: int, say: str | None = None, **fields) -> None:
        """Record an event (rank 0 writes; call it on every rank with the same arguments) and, if
        ``say`` is given, print it as a rank-0 line."""
        if self.shared:
            self._write(
                self.shared, {"type": "event", "event": name, "step": step, "time": time.time(), **fields}
            )
            if say:
                print(f"[{name}] step {step}: {say}", flush=True)

    def _comm_now(self) -> list[float]:
        """calls, bytes, seconds per kind, summed over the world's and the groups' CommStats (a
        CommStats shared by several of them counted once)."""
        total = [0.0] * (3 * len(KINDS))
        distinct = {id(c.stats): c.stats for c in (self.comm, *self.groups.values()) if c.stats is not None}
        for stats in distinct.values():
            total = [a + b for a, b in zip(total, stats.as_vector())]
        return total

    def _group_bytes_now(self) -> dict[str, int]:
        return {
            name: sum(c.stats.bytes_sent.values()) if c.stats is not None else 0
            for name, c in self.groups.items()
        }

    def begin_step(self) -> None:
        """Start the step's collective accounting window (it ends when ``step`` is called), so a
        record's comm figures cover the same stretch as its step_time_s."""
        self._comm_seen = self._comm_now()
        self._group_seen = self._group_bytes_now()

    def row(self, seconds: float, memory: dict[str, int]) -> list[float]:
        """This rank's part of the step's record, ``ROW_WIDTH`` floats: memory, step time, and the
        collective traffic since begin_step (the trainer gathers it with the step's other parts)."""
        comm_delta = [now - seen for now, seen in zip(self._comm_now(), self._comm_seen)]
        return _memory_row(memory) + [seconds] + comm_delta

    def step(
        self,
        step: int,
        *,
        loss: float,
        local_loss: float,
        grad_norm: float,
        param_norm: float,
        lr: float,
        seconds: float,
        memory: dict[str, int],
        val_loss: float | None = None,
        rows: list[list[float]] | None = None,
        model_fields: dict | None = None,
        defer: bool = False,
    ) -> dict | None:
        """One step's record from every rank's ``row`` (``rows``, gathered by the caller with the
        step's other values), or, without them, through a gather of its own. Every rank calls it.
        ``model_fields``: what the model adds (the same on every rank; mixtral: ``aux_loss``,
        ``expert_tokens``). ``defer``: rank 0 returns the record, its line and first memory event
        unwritten (a JSON value: ``emit`` writes it), for the caller to keep it first."""
        # Bytes this rank really sent on each group since begin_step (rank 0's go in the record).
        comm_bytes = {name: now - self._group_seen[name] for name, now in self._group_bytes_now().items()}
        rows = rows if rows is not None else agree.gather(self.row(seconds, memory), self.comm)
        mine = rows[self.comm.rank]
        if self.own:
            self._write(
                self.own,
                {
                    "type": "step",
                    "step": step,
                    "rank": self.comm.rank,
                    "local_loss": json_number(local_loss),
                    "grad_norm": json_number(grad_norm),
                    "step_time_s": seconds,
                    **_memory_fields(mine[:SECONDS]),
                    "comm": self._comm_fields([mine]),
                },
            )
        # busy: outside collectives (the seconds of every kind, waiting included, come off)
        slow = slowest([r[SECONDS] - sum(r[SECONDS + 3 + 3 * k] for k in range(len(KINDS))) for r in rows])
        if self.stragglers.update(slow):
            self.event(
                "straggler",
                step,
                say=f"rank {slow.rank} busy {slow.ratio:.2f} x the median rank for "
                f"{self.stragglers.window} steps",
                **slow.fields(),
                steps=self.stragglers.window,
            )
        if not self.shared:
            return
        tokens_per_s = self.tokens_per_step / seconds if seconds > 0 else None
        util = mfu(self.model_flops, seconds, self.peak_flops)
        record = {
            "type": "step",
            "step": step,
            "time": time.time(),
            "loss": json_number(loss),
            "loss_hex": loss.hex(),
            "grad_norm": json_number(grad_norm),
            "param_norm": json_number(param_norm),
            "lr": lr,
            "step_time_s": seconds,
            "step_time_s_max": max(r[SECONDS] for r in rows),
            "tokens": self.tokens_per_step,
            "tokens_per_s": tokens_per_s,
            "mfu": util,
            "peak_flops": self.peak_flops,
            "slowest": slow.fields(),
            "comm": self._comm_fields(rows),
            "memory": {
                k: _stats([r[i] for r in rows])
                for i, k in enumerate(MEMORY_KEYS)
                if not math.isnan(rows[0][i])
            },
        }
        if comm_bytes:
            record["comm_bytes"] = comm_bytes
        if val_loss is not None:
            record.update(val_loss=json_number(val_loss), val_loss_hex=val_loss.hex())
        record.update(model_fields or {})
        every = self.cfg.progress_every
        line = None
        if every and (step % every == 0 or step == self.total_steps):
            comm_ms = 1000 * sum(v["seconds"]["mean"] for v in record["comm"].values())
            line = (
                f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}  loss {loss:.6f}  "
                f"grad norm {grad_norm:.4f}  lr {lr:.3g}  {1000 * seconds:.1f} ms  "
                f"{(tokens_per_s or 0) / 1000:.1f}k tok/s  mfu {100 * (util or 0):.2f}%  "
                f"comm {comm_ms:.1f} ms" + (f"  val loss {val_loss:.6f}" if val_loss is not None else "")
            )
        pending = {"record": record, "line": line, "memory_rows": None if self._memory_logged else rows}
        if defer:
            return pending
        self.emit(pending)
        return None

    def emit(self, pending: dict | None) -> None:
        """Write a step's record held by ``step(defer=True)`` (rank 0; None elsewhere): the metrics
        file, TensorBoard, the first step's memory event, the progress line."""
        if pending is None:
            return
        record = pending["record"]
        self._write(self.shared, record)
        if self.tensorboard:
            self.tensorboard.write(record)
        if pending["memory_rows"] is not None and not self._memory_logged:
            self._memory_event(record["step"], pending["memory_rows"])
        if pending["line"]:
            print(pending["line"], flush=True)

    def recover(self, pending: dict | None) -> None:
        """A resumed run's first act: the record of the step it resumed from, held in rank 0's memory
        snapshot of it, written if the file does not end with it (the job lost a rank after the
        snapshot round and before the record: the step is done, and recorded once)."""
        if pending is not None and self.shared is not None:
            if records.last_step(Path(self.shared.name)) != pending["record"]["step"]:
                self.emit(pending)

    @staticmethod
    def _comm_fields(rows: list[list[float]]) -> dict:
        out = {}
        for k, kind in enumerate(KINDS):
            calls, sent, secs = ([r[SECONDS + 1 + 3 * k + j] for r in rows] for j in range(3))
            if max(calls) > 0:
                out[kind] = {"calls": int(max(calls)), "bytes": _stats(sent), "seconds": _stats(secs)}
        return out

    def _memory_event(self, step: int, rows: list[list[float]]) -> None:
        """A "memory" event with every rank's bytes (for the per-rank chart); rank 0 only."""
        self._memory_logged = True
        per_rank = [{"rank": r, **_memory_fields(row[:SECONDS])} for r, row in enumerate(rows)]
        self.event("memory", step, per_rank=per_rank)

    def final_memory(self, step: int, memory: dict[str, int]) -> None:
        """Every rank's memory at the end of the run, peak RSS included. Collective."""
        rows = agree.gather(_memory_row(memory), self.comm)
        if self.shared:
            self._memory_event(step, rows)


def last_event(path: Path, name: str, since: float = 0.0) -> dict | None:
    """The last ``name`` event logged at or after ``since`` (unix time) in a metrics file."""
    found = None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("type") == "event" and record.get("event") == name and record.get("time", 0) >= since:
            found = record
    return found
