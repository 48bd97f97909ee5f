"""What a checkpoint of this application holds: each rank's state, and the manifest's run-wide part.

``state`` is one rank's shard: its optimizer partition (fp32 master, exp_avg, exp_avg_sq), its RNG
states (torch and numpy as tensors; python and numpy's position in ``rank_state``), and the step,
optimizer step count and data position. ``meta`` is what rank 0 writes into the manifest next to
the files: ZeRO stage, seed, model and data config, data position, the flat layout, and the mesh
(with tensor or pipeline parallelism, every rank's layout, so the shards can be reassembled).
``extras`` are the run-level files every checkpoint carries, listed and hashed in its manifest:
a BPE run's tokenizer, so the weights never travel without the ids' meaning.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from distlib.app.checkpointing import state_buffers
from distlib.app.config.data_group import DataConfig
from distlib.app.config.run import RunConfig
from distlib.app.data.batches import GlobalBatches
from distlib.app.data.bpe import TOKENIZER_FILES
from distlib.app.model.bias_balance import state_names
from distlib.app.model.pipeline import stage_layouts
from distlib.checkpoint import rng_state
from distlib.checkpoint.staging import StagingBuffers
from distlib.comm import agree
from distlib.comm.mesh import Mesh
from distlib.parallel.flat_layout import FlatLayout, Partition
from distlib.parallel.tensor_parallel import Split, manifest_layouts
from distlib.parallel.zero import ZeroOptimizer


class Contents:
    def __init__(
        self,
        cfg: RunConfig,
        mesh: Mesh,
        data: GlobalBatches,
        optimizer: ZeroOptimizer,
        tp_splits: dict[str, Split],
        run_dir: Path | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
    ):
        self.cfg, self.mesh, self.data, self.optimizer, self.tp_splits = cfg, mesh, data, optimizer, tp_splits
        self.run_dir = run_dir
        # model state besides the parameters (model.balance=bias), and which file keeps each
        self.buffers = buffers or {}
        names = state_names(cfg.model)
        self.buffer_files = state_buffers.holders(self.buffers, names, mesh.world) if names else {}
        held = optimizer.partitions()
        self.layout = held[0].layout  # the first parameter group's: the manifest's "layout"
        self.pp_meta = stage_layouts(mesh, self.layout, tp_splits)  # (collective; {} at dist.pp=1)
        self.group_meta = group_holdings(mesh, held[1:], tp_splits)  # (collective; {} with one group)

    def state(
        self,
        step: int,
        optimizer: ZeroOptimizer,
        skipped: int | None = None,
        staging: StagingBuffers | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
        live: bool = False,
    ) -> tuple[dict, dict]:
        """(tensors, rank_state) of this rank: ``optimizer``'s partition (fresh host copies, copied
        into ``staging``'s reused buffers, or ``live``: the optimizer's own, for a caller done with
        them before its next update), the state buffers (``buffers``: another model's, as the
        resume check's fresh one; None: the run's), RNG, step and data position."""
        skipped = self.data.skipped if skipped is None else skipped
        rng_tensors, rng_meta = rng_state.capture_rng(optimizer.device)
        shard = _partition(optimizer, staging, live)
        rank_state = {
            "step": step,
            "optimizer_steps": optimizer.step_count,
            "data": self.data.position(step, skipped),
            "rng": rng_meta,
        }
        if skipped:
            rank_state["skipped_batches"] = skipped
        held = self.buffers if buffers is None else buffers
        return {**shard, **rng_tensors, **state_buffers.captured(held)}, rank_state

    def meta(self, step: int) -> dict:
        """The manifest's run-wide part for a save after ``step``."""
        meta = {
            "zero_stage": self.cfg.zero.stage,
            "seed": self.cfg.seed,
            "model": dataclasses.asdict(self.cfg.model),
            "data": self.data.position(step),
            "data_config": data_config(self.cfg.data),
            "layout": self.layout.to_dict(),
            **self._parallel_meta(),
        }
        if self.data.skipped:  # guard.skip_batches: part of the data position (docs/unattended.md)
            meta["skipped_batches"] = self.data.skipped
        if self.buffer_files:
            meta["state_buffers"] = self.buffer_files
        return meta

    def extras(self) -> dict[str, Path]:
        """Path inside a checkpoint -> the file rank 0 copies there: a BPE or existing tokenizer's
        files, which rank 0 saved as <run dir>/tokenizer/ at start (``data.build``)."""
        if self.cfg.data.kind != "text" or self.cfg.data.tokenizer == "bytes" or self.run_dir is None:
            return {}
        saved = Path(self.run_dir) / "tokenizer"  # (an existing tokenizer's directory may lack some)
        return {f"tokenizer/{name}": saved / name for name in TOKENIZER_FILES if (saved / name).is_file()}

    def _parallel_meta(self) -> dict:
        """The mesh, and with tensor parallelism each TP rank's flat layout with how every local
        parameter maps to the full one (split dim, groups, index), so the shards can be reassembled."""
        tp = self.mesh.tp.size
        meta = {
            "tp": tp,
            "dp": self.mesh.dp.size,
            "parallel": self.mesh.layout.to_dict(),  # the dimensions by name, in the rank order
            "param_dtype": self.cfg.train.dtype,
        }
        if tp > 1:
            meta["tp_layouts"] = manifest_layouts(self.layout.to_dict(), self.tp_splits)
        return {**meta, **self.pp_meta, **self.group_meta}


def group_holdings(mesh: Mesh, partitions: list[Partition], tp_splits: dict[str, Split]) -> dict:
    """The manifest's ``group_holdings`` (collective over the world; {} when no rank holds more
    than the first group): each flat layout of the other groups (the experts a set of ranks holds,
    with their tensor-parallel splits), the key prefix of its state, the tensor rank that holds it
    and the file holding each of its partitions. Every rank tells what it holds; the same layout
    told by several ranks is one holding, partitioned over them."""
    if not partitions:
        return {}
    tp = mesh.tp.rank
    mine = [
        {"prefix": p.prefix, "tp_rank": tp, "layout": _with_splits(p.layout, tp_splits, tp), "part": p.rank}
        for p in partitions
    ]
    held: dict[str, dict] = {}
    for rank, blob in enumerate(agree.gather_bytes(json.dumps(mine).encode(), mesh.world)):
        for told in json.loads(blob):
            entry = held.setdefault(
                json.dumps([told["prefix"], told["layout"]], sort_keys=True),
                {k: told[k] for k in ("prefix", "tp_rank", "layout")}
                | {"files": [None] * told["layout"]["world_size"]},
            )
            entry["files"][told["part"]] = rank
    return {"group_holdings": list(held.values())}


def _with_splits(layout: FlatLayout, tp_splits: dict[str, Split], tp_rank: int) -> dict:
    """``layout``'s manifest dict, with tensor parallelism every parameter's full shape and cut."""
    return manifest_layouts(layout.to_dict(), tp_splits)[tp_rank] if tp_splits else layout.to_dict()


def data_config(data: DataConfig) -> dict:
    """The manifest's copy of the data config. A byte-level run leaves out the tokenizer keys, which
    hold their defaults then, and a run without an existing tokenizer leaves out data.text_field: its
    manifest stays byte for byte what it was before they existed (a missing key reads as its
    default, ``manifest_config``); and a run without data.mixture leaves out its keys.
    data.document_mask is never recorded: it changes attention, not which tokens are read, so a
    resume may turn it on or off."""
    record = data.to_dict()
    record.pop("document_mask")
    if data.tokenizer == "bytes":
        record.pop("tokenizer")
        record.pop("vocab_size")
    if not data.pretrained:  # read with an existing tokenizer's documents only
        record.pop("text_field")
    if data.mixture is None:
        record.pop("mixture")
        record.pop("weights")
    return record


def _partition(optimizer: ZeroOptimizer, staging: StagingBuffers | None, live: bool) -> dict:
    if live:
        return optimizer.state_views()
    if staging is not None:
        return staging.stage(optimizer.state_views())
    return optimizer.state_shard()
