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
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from distlib import agree, checkpoint
from distlib.comm import Comm
from distlib.config import RunConfig
from distlib.data import BatchPlan, GlobalBatches, make_corpus
from distlib.ddp import DataParallel
from distlib.mesh import build_mesh
from distlib.model import MiniGPT, build_model
from distlib.tensor_parallel import layout_params, shard_model_, splits_for_rank
from distlib.flat_layout import FlatLayout
from distlib.zero import ZeroOptimizer, make_optimizer


@dataclass
class StepLog:
    step: int
    loss: float
    grad_norm: float
    param_norms: list[float]     # one per rank, after the update
    seconds: float


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


def _full_shape(local: tuple[int, ...], split) -> tuple[int, ...]:
    if split is None:
        return local
    return tuple(n * split.parts if d == split.dim else n for d, n in enumerate(local))


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
        corpus = make_corpus(cfg.data.seed, cfg.data.total_tokens, cfg.model.vocab_size, cfg.data.follow_prob)
        self.data = GlobalBatches(corpus, cfg.model.seq_len, plan, cfg.seed)
        self.model, self.optimizer = self.build(seed=cfg.seed)

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
                "model": dataclasses.asdict(self.cfg.model), "layout": self.optimizer.layout.to_dict(),
                **self._parallel_meta()}
        path = checkpoint.save(self.ckpt_root, step, tensors, rank_state, meta, self.comm)
        return tensors, rank_state, checkpoint.read_manifest(path)

    def load(self, path: Path, model: MiniGPT, optimizer: ZeroOptimizer) -> int:
        """Verify ``path`` (rank 0 hashes every file, all ranks hear the verdict), then restore
        this rank's optimizer partition, parameters, RNG and data position. Returns the step."""
        error = ""
        if self.comm.rank == 0:
            try:
                checkpoint.verify(path)
            except checkpoint.CheckpointError as exc:
                error = str(exc)
        errors = [b.decode() for b in agree.gather_bytes(error.encode(), self.comm)]
        if errors[0]:
            raise checkpoint.CheckpointError(errors[0])
        manifest = checkpoint.read_manifest(path)
        self._check_compatible(path, manifest, optimizer.layout)
        tensors, rank_state = checkpoint.load_shard(path, self.comm.rank)
        expected_position = self.data.position(manifest["step"])
        if rank_state["data"] != expected_position:
            raise checkpoint.CheckpointError(
                f"checkpoint {path}: data position {rank_state['data']} cannot continue with this "
                f"configuration's {expected_position} (seed or global batch differ)")
        optimizer.load_state_shard(tensors, rank_state["optimizer_steps"])
        checkpoint.restore_rng(tensors, rank_state["rng"])
        return int(manifest["step"])

    def _parallel_meta(self) -> dict:
        """The mesh, and with tensor parallelism each TP rank's flat layout with how every local
        parameter maps to the full one (split dim, groups, index), so the shards can be reassembled."""
        tp, opt = self.mesh.tp.size, self.optimizer
        meta = {"tp": tp, "dp": self.mesh.dp.size, "rank_order": "global rank = dp_rank * tp + tp_rank",
                "param_dtype": self.cfg.train.dtype}
        if tp > 1:
            layouts = []
            for t in range(tp):
                splits = splits_for_rank(opt.tp.splits, t)
                full = {s.name: _full_shape(s.shape, opt.tp.splits.get(s.name)) for s in opt.layout.slots}
                layouts.append(layout_params(opt.layout.to_dict(), full, splits))
            meta["tp_layouts"] = layouts
        return meta

    def _check_compatible(self, path: Path, manifest: dict, layout: FlatLayout) -> None:
        problems = []
        if manifest["world_size"] != self.comm.size:
            problems.append(f"saved with world size {manifest['world_size']}, this run has {self.comm.size}")
        if manifest.get("tp", 1) != self.mesh.tp.size:
            problems.append(f"saved with dist.tp={manifest.get('tp', 1)}, this run has dist.tp={self.mesh.tp.size}")
            raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this run: " + "; ".join(problems))
        saved = FlatLayout.from_dict(manifest.get("tp_layouts", [manifest["layout"]])[self.mesh.tp.rank])
        if saved.slots != layout.slots:
            ours = {s.name: s.shape for s in layout.slots}
            theirs = {s.name: s.shape for s in saved.slots}
            for name in sorted(set(ours) | set(theirs)):
                if ours.get(name) != theirs.get(name):
                    problems.append(f"{name}: checkpoint {theirs.get(name)}, model {ours.get(name)}")
            if not problems:
                problems.append("parameter order or offsets differ")
        if problems:
            raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this run: " + "; ".join(problems))

    def resolve_resume(self) -> Path | None:
        resume = self.cfg.checkpoint.resume
        if resume in (None, "", "none", "null"):
            return None
        if resume == "latest":
            found = checkpoint.list_committed(self.ckpt_root)
            return found[-1] if found else None
        return Path(resume)

    # -- the loop -------------------------------------------------------------
    def run(self) -> RunResult:
        cfg, comm = self.cfg, self.comm
        start = 0
        resume_path = self.resolve_resume()
        if resume_path is not None:
            start = self.load(resume_path, self.model, self.optimizer)
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
                result.steps.append(StepLog(step, global_loss, grad_norm, norms, seconds))
                if metrics:
                    metrics.write(json.dumps({"step": step, "loss": global_loss, "loss_hex": global_loss.hex(),
                                              "grad_norm": grad_norm, "param_norm": norms[0],
                                              "lr": cfg.optimizer.adamw.lr, "step_time_s": seconds,
                                              "comm_bytes": self.optimizer.last_step_comm_bytes,
                                              "optimizer_bytes": self.optimizer.memory_bytes()["optimizer"]})
                                  + "\n")
                    metrics.flush()
                if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                    tensors, rank_state, manifest = self.save(step)
                    result.manifests.append(manifest)
                    if snapshot is None:
                        snapshot = (step, tensors, rank_state, self.optimizer.params_snapshot())
        finally:
            if metrics:
                metrics.close()
        result.memory = self.memory_report()
        if snapshot is not None and cfg.checkpoint.verify_resume:
            result.resume_check = self.verify_resume(*snapshot)
        return result

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
