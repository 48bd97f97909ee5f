"""The training loop: forward, backward, one ZeRO step, logging, checkpoints.

It composes narrow APIs in order and knows nothing about how they talk:
``DataParallel`` (initial broadcast), ``ZeroOptimizer.step`` (gradient sync +
update + parameter all-gather), ``checkpoint.save/verify/load_shard``, and
``agree`` for the few values ranks must share (the logged loss, per-rank norms,
memory reports).
"""
from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from distlib import agree, checkpoint, data, reshard
from distlib.comm import Comm
from distlib.config import RunConfig
from distlib.data import BatchPlan
from distlib.ddp import DataParallel
from distlib.fault import Faults
from distlib.mesh import build_mesh
from distlib.model import MiniGPT, build_model
from distlib.tensor_parallel import manifest_layouts, shard_model_
from distlib.flat_layout import FlatLayout
from distlib.zero import ZeroOptimizer, make_optimizer


@dataclass
class StepLog:
    step: int
    loss: float
    grad_norm: float
    param_norms: list[float]     # one per rank, after the update
    seconds: float
    val_loss: float | None = None  # held-out loss after this step, on evaluation steps


@dataclass
class ResumeCheck:
    step: int
    mismatches: list[str]        # "rank R: what differed"; empty means byte-identical

    @property
    def ok(self) -> bool:
        return not self.mismatches


@dataclass
class RunResult:
    start_step: int
    steps: list[StepLog] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)   # per rank: measured / expected / allowance
    manifests: list[dict] = field(default_factory=list)
    resume_check: ResumeCheck | None = None
    numel: int = 0


def seed_process_rngs(seed: int, rank: int) -> None:
    """Seed the global torch / numpy / python RNGs (dropout and anything else that draws from
    them), differently per rank, so that two runs of the same config are byte-identical."""
    torch.manual_seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    random.seed(seed + rank)


def _shape(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else "x".join(map(str, shape)) or "scalar"


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


class Trainer:
    def __init__(self, cfg: RunConfig, comm: Comm, run_dir: Path):
        self.cfg, self.comm, self.run_dir = cfg, comm, Path(run_dir)
        self.mesh = build_mesh(comm, cfg.dist.tp)
        # Tensor-parallel ranks of one data-parallel group draw the same dropout masks.
        seed_process_rngs(cfg.seed, self.mesh.dp.rank)
        self.ckpt_root = self.run_dir / cfg.checkpoint.dir
        plan = BatchPlan(cfg.global_batch, self.mesh.dp.size, cfg.train.grad_accum)
        self.data, self.heldout = data.build(cfg, comm, plan)
        self.model, self.optimizer = self.build(seed=cfg.seed)
        self.faults = Faults(cfg.fault, comm.rank)

    def say(self, message: str) -> None:
        """One line on rank 0's stdout (every rank knows the same facts; one speaks)."""
        if self.comm.rank == 0:
            print(message, flush=True)

    def build(self, seed: int) -> tuple[MiniGPT, ZeroOptimizer]:
        model = DataParallel(build_model(self.cfg.model, seed), self.comm).module
        tp_group = shard_model_(model, self.mesh.tp)
        optimizer = make_optimizer(model, self.mesh.dp, self.cfg.zero.stage, self.cfg.optimizer.adamw,
                                   self.cfg.optimizer.grad_clip, tp=tp_group, param_dtype=self.cfg.param_dtype,
                                   bucket_numel=self.cfg.zero.bucket_numel)
        return model, optimizer

    # -- checkpoints ----------------------------------------------------------
    def _state(self, step: int, optimizer: ZeroOptimizer) -> tuple[dict, dict]:
        rng_tensors, rng_meta = checkpoint.capture_rng()
        tensors = {**optimizer.state_shard(), **rng_tensors}
        rank_state = {"step": step, "optimizer_steps": optimizer.step_count,
                      "data": self.data.position(step), "rng": rng_meta}
        return tensors, rank_state

    def save(self, step: int) -> tuple[dict, dict, dict]:
        tensors, rank_state = self._state(step, self.optimizer)
        meta = {"zero_stage": self.cfg.zero.stage, "seed": self.cfg.seed,
                "model": dataclasses.asdict(self.cfg.model), "data": self.data.position(step),
                "data_config": dataclasses.asdict(self.cfg.data), "layout": self.optimizer.layout.to_dict(),
                **self._parallel_meta()}
        path = checkpoint.save(self.ckpt_root, step, tensors, rank_state, meta, self.comm,
                               self.faults.save_hook(step))
        if self.comm.rank == 0 and self.cfg.checkpoint.keep_last:
            try:
                for old in checkpoint.prune(self.ckpt_root, self.cfg.checkpoint.keep_last):
                    print(f"checkpoint: removed {old} (checkpoint.keep_last={self.cfg.checkpoint.keep_last})")
            except OSError as exc:  # training can go on; the operator must hear about it
                print(f"warning: checkpoint.keep_last could not remove an old checkpoint: {exc}", file=sys.stderr)
        return tensors, rank_state, checkpoint.read_manifest(path)

    def load(self, path: Path, model: MiniGPT, optimizer: ZeroOptimizer, verified: bool = False) -> int:
        """Verify ``path`` (the ranks hash its files between them and share the verdict), check it fits,
        then restore this rank's optimizer partition (resharded if the checkpoint's world size
        differs), parameters, RNG and data position. Nothing is loaded unless all of it fits."""
        path = Path(path)
        if not verified:
            checkpoint.verify_collectively(path, self.comm)
        manifest = checkpoint.agreed(lambda: checkpoint.read_manifest(path), self.comm)
        self._check_compatible(path, manifest, optimizer.layout)
        state, rank_state, rng = checkpoint.agreed(
            lambda: reshard.load_partition(path, manifest, self.mesh.dp.rank, self.mesh.dp.size, self.mesh.tp.rank),
            self.comm)
        optimizer.load_state_shard(state, rank_state["optimizer_steps"])
        if rng is not None:
            checkpoint.restore_rng(rng, rank_state["rng"])
        else:
            seed_process_rngs(self.cfg.seed, self.mesh.dp.rank)
        reseeded = [r for r, (had,) in enumerate(agree.gather([float(rng is not None)], self.comm)) if not had]
        if manifest["world_size"] != self.comm.size:
            self.say(f"resharded checkpoint {path}: saved by {manifest['world_size']} rank(s) at ZeRO stage "
                     f"{manifest.get('zero_stage')}, loaded into {self.comm.size} at stage {self.cfg.zero.stage}; "
                     f"the data position carries over (same global batch, {self.cfg.global_batch})")
        if reseeded:
            self.say(f"rank(s) {reseeded} have no saved RNG state in {path} (it was saved by fewer ranks): "
                     f"re-seeded from seed + rank; dropout draws differ from the original run")
        return int(manifest["step"])

    def _parallel_meta(self) -> dict:
        """The mesh, and with tensor parallelism each TP rank's flat layout with how every local
        parameter maps to the full one (split dim, groups, index), so the shards can be reassembled."""
        tp = self.mesh.tp.size
        meta = {"tp": tp, "dp": self.mesh.dp.size, "rank_order": "global rank = dp_rank * tp + tp_rank",
                "param_dtype": self.cfg.train.dtype}
        if tp > 1:
            meta["tp_layouts"] = manifest_layouts(self.optimizer.layout.to_dict(), self.optimizer.tp.splits)
        return meta

    def _check_compatible(self, path: Path, manifest: dict, layout: FlatLayout) -> None:
        """Refuse, listing every difference, a checkpoint whose parameters or data stream differ."""
        problems = []
        if manifest.get("tp", 1) != self.mesh.tp.size:
            raise checkpoint.CheckpointError(
                f"checkpoint {path} does not fit this run, nothing was loaded: saved with dist.tp="
                f"{manifest.get('tp', 1)}, this run has dist.tp={self.mesh.tp.size} (resharding across "
                f"tensor-parallel degrees is not supported)")
        saved = FlatLayout.from_dict(manifest.get("tp_layouts", [manifest["layout"]])[self.mesh.tp.rank])
        if saved.slots != layout.slots:
            model = dataclasses.asdict(self.cfg.model)
            for key, value in manifest.get("model", {}).items():
                if model.get(key) != value:
                    problems.append(f"model.{key}: checkpoint {value}, this run {model.get(key)}")
            ours = {s.name: s.shape for s in layout.slots}
            theirs = {s.name: s.shape for s in saved.slots}
            shapes = [f"parameter {name}: checkpoint {_shape(theirs.get(name))}, model {_shape(ours.get(name))}"
                      for name in [s.name for s in saved.slots] + [n for n in ours if n not in theirs]
                      if ours.get(name) != theirs.get(name)]
            problems += shapes or ["same parameters and shapes, but a different order in the flat layout"]
        data_config = dataclasses.asdict(self.cfg.data)
        for key, value in manifest.get("data_config", {}).items():
            # A text file is identified by its sha256 (the position's "source"), not by where it
            # or its token file lives, so a moved file still resumes and a changed one does not.
            if key not in ("path", "cache_dir") and data_config.get(key) != value:
                problems.append(f"data.{key}: checkpoint {value}, this run {data_config.get(key)} "
                                f"(a different corpus)")
        saved_position, position = manifest.get("data"), self.data.position(int(manifest["step"]))
        if saved_position and saved_position != position:
            if saved_position["global_batch"] != position["global_batch"]:
                problems.append(
                    f"global batch: checkpoint {saved_position['global_batch']} sequences per step, this run "
                    f"{position['global_batch']}; the data order cannot continue exactly. Set "
                    f"train.global_batch={saved_position['global_batch']} (any world size that divides it)")
            if saved_position["seed"] != position["seed"]:
                problems.append(f"seed (data order): checkpoint {saved_position['seed']}, this run {position['seed']}")
            if saved_position.get("source") != position.get("source"):
                problems.append(f"data source: checkpoint {saved_position.get('source')}, this run "
                                f"{position.get('source')} (the text file's content changed)")
            if saved_position["num_windows"] != position["num_windows"]:
                problems.append(f"training windows in the corpus: checkpoint {saved_position['num_windows']}, "
                                f"this run {position['num_windows']}")
        if problems:
            raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this run, nothing was loaded:\n  "
                                             + "\n  ".join(problems))

    def resolve_resume(self) -> tuple[Path | None, bool]:
        """(checkpoint to resume from or None, whether it has been verified already). For "latest",
        the ranks verify the candidates together, newest first; damaged ones are moved aside."""
        resume = self.cfg.checkpoint.resume
        if resume in (None, "", "none", "null"):
            return None, False
        if resume != "latest":
            return Path(resume), False
        listing = json.dumps([str(p) for p in checkpoint.list_committed(self.ckpt_root)]) if self.comm.rank == 0 else ""
        candidates = [Path(p) for p in json.loads(agree.gather_bytes(listing.encode(), self.comm)[0])]
        damaged = []
        for path in reversed(candidates):
            try:
                checkpoint.verify_collectively(path, self.comm)
            except checkpoint.CheckpointError as exc:
                damaged.append((path, str(exc)))
                continue
            break
        else:
            if damaged:
                raise checkpoint.CheckpointError(
                    f"checkpoint.resume=latest: none of the {len(damaged)} checkpoint(s) in {self.ckpt_root} "
                    f"verifies; the newest: {damaged[0][1]}")
            self.say(f"resume: no checkpoint in {self.ckpt_root}; starting fresh")
            return None, False
        if self.comm.rank == 0:
            for bad, problem in damaged:
                # Moved aside, not deleted: kept for inspection, and the rerun can save that step again.
                print(f"resume: skipping a damaged checkpoint (moved to {checkpoint.quarantine(bad)}): {problem}",
                      file=sys.stderr, flush=True)
        self.say(f"resume: latest valid checkpoint is {path}")
        return path, True

    # -- the loop -------------------------------------------------------------
    def run(self) -> RunResult:
        cfg, comm = self.cfg, self.comm
        start = 0
        resume_path, verified = self.resolve_resume()
        if resume_path is not None:
            start = self.load(resume_path, self.model, self.optimizer, verified)
            self.say(f"resumed from {resume_path} at step {start}")
        result = RunResult(start_step=start, numel=self.optimizer.layout.numel)
        snapshot = None
        metrics = open(self.run_dir / "metrics.jsonl", "a") if comm.rank == 0 else None
        try:
            for step in range(start + 1, cfg.train.steps + 1):
                began = time.perf_counter()
                self.model.train()
                local_loss = 0.0
                for inputs, targets in self.data.micro_batches(step - 1, self.mesh.dp.rank):
                    loss = self.model(inputs, targets) / cfg.train.grad_accum
                    loss.backward()
                    local_loss += float(loss.detach())
                grad_norm = self.optimizer.step()
                self.optimizer.zero_grad()
                global_loss = agree.mean(local_loss, self.mesh.dp)  # TP ranks of a group share a loss
                norms = [row[0] for row in agree.gather([self.optimizer.param_norm()], comm)]
                seconds = time.perf_counter() - began
                val_loss = self.evaluate() if cfg.train.eval_every and step % cfg.train.eval_every == 0 else None
                result.steps.append(StepLog(step, global_loss, grad_norm, norms, seconds, val_loss))
                if metrics:
                    record = {"step": step, "loss": global_loss, "loss_hex": global_loss.hex(),
                              "grad_norm": grad_norm, "param_norm": norms[0],
                              "lr": cfg.optimizer.adamw.lr, "step_time_s": seconds,
                              "comm_bytes": self.optimizer.last_step_comm_bytes,
                              "optimizer_bytes": self.optimizer.memory_bytes()["optimizer"]}
                    if val_loss is not None:
                        record.update(val_loss=val_loss, val_loss_hex=val_loss.hex())
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                    tensors, rank_state, manifest = self.save(step)
                    result.manifests.append(manifest)
                    # With keep_last the first checkpoint may be pruned; the newest never is.
                    if snapshot is None or cfg.checkpoint.keep_last:
                        snapshot = (step, tensors, rank_state, self.optimizer.params_snapshot())
                self.faults.after_step(step)
        finally:
            if metrics:
                metrics.close()
        result.memory = self.memory_report()
        if snapshot is not None and cfg.checkpoint.verify_resume:
            result.resume_check = self.verify_resume(*snapshot)
        return result

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean per-token loss over the held-out windows: each data-parallel rank scores its share
        (the tensor-parallel ranks of a group score it together), the (sum, count) pairs are
        combined in rank order, so every rank gets the same value."""
        dp = self.mesh.dp
        batches = self.heldout.batches(dp.rank, dp.size, self.data.plan.micro_batch)
        # With ZeRO-3 or tensor parallelism every forward is collective: all ranks run as many
        # as the busiest one (the extra ones score nothing).
        forwards = int(max(row[0] for row in agree.gather([float(len(batches))], dp)))
        idle = torch.zeros(1, self.cfg.model.seq_len, dtype=torch.int64)
        self.model.eval()
        total, count = 0.0, 0
        try:
            for i in range(forwards):
                inputs, targets = batches[i] if i < len(batches) else (idle, idle)
                loss = float(self.model(inputs, targets))
                if i < len(batches):
                    total += loss * targets.numel()
                    count += targets.numel()
        finally:
            self.model.train()
        rows = agree.gather([total, float(count)], dp)
        return sum(row[0] for row in rows) / sum(row[1] for row in rows)

    def memory_report(self) -> list[dict]:
        measured = self.optimizer.memory_bytes()
        keys = sorted(measured)
        rows = agree.gather([float(measured[k]) for k in keys], self.comm)
        formula = self.optimizer.memory_formula()
        expected, allowance = ({k: v[i] for k, v in formula.items()} for i in (0, 1))
        text = {k: v[2] for k, v in formula.items()}
        return [{"rank": r, "measured": dict(zip(keys, map(int, row))), "expected": expected,
                 "allowance": allowance, "formula": text} for r, row in enumerate(rows)]

    def verify_resume(self, step: int, tensors: dict, rank_state: dict, params: torch.Tensor) -> ResumeCheck:
        """Reload the checkpoint of ``step`` into a freshly built model and optimizer (initialised
        from a different seed) and compare every restored byte with the snapshot taken at save."""
        model, optimizer = self.build(seed=self.cfg.seed + 1)
        loaded_step = self.load(self.ckpt_root / checkpoint.step_dir_name(step), model, optimizer)
        restored_tensors, restored_state = self._state(loaded_step, optimizer)
        mismatches = []
        for key in sorted(tensors):
            if _bytes(tensors[key]) != _bytes(restored_tensors[key]):
                mismatches.append(f"{key} differs")
        if _bytes(params) != _bytes(optimizer.params_snapshot()):
            mismatches.append("model parameters differ")
        if rank_state != json.loads(json.dumps(restored_state)):
            mismatches.append("step, data position or python/numpy RNG differ")
        reports = agree.gather_bytes(json.dumps(mismatches).encode(), self.comm)
        every = [f"rank {r}: {m}" for r, rep in enumerate(reports) for m in json.loads(rep)]
        return ResumeCheck(step, every)
