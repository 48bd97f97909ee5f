"""Invariant 4, the resume check: reload the checkpoint a run kept a snapshot of into a freshly
built model and optimizer and compare every restored byte, and what the restored generators draw.
``Checkpointer.verify_resume`` calls it at the end of a run."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch

from distlib.checkpoint import sharded as checkpoint
from distlib.comm import agree
from distlib.app.checkpointing.rng import process_rng_draws, saved_rng_draws, seed_process_rngs
from distlib.parallel.zero import ZeroOptimizer

@dataclass
class ResumeCheck:
    step: int
    mismatches: list[str]        # "rank R: what differed"; empty means byte-identical

    @property
    def ok(self) -> bool:
        return not self.mismatches


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()


def verify_resume(ckpt, build: Callable[[], tuple[torch.nn.Module, ZeroOptimizer]]) -> ResumeCheck | None:
    """Reload the snapshot's checkpoint of ``ckpt`` (the run's ``Checkpointer``) into a freshly
    built model and optimizer (``build``: one initialised from a different seed) with the process
    RNGs re-seeded differently, and compare every restored byte with the snapshot taken at save,
    and what the restored generators draw with what the saved ones draw. None: nothing to check
    (no save, or switched off)."""
    if ckpt.snapshot is None or not ckpt.cfg.checkpoint.verify_resume:
        return None
    step, tensors, rank_state, params = ckpt.snapshot
    model, optimizer = build()
    # Without this a restore that does nothing would pass whenever nothing drew since the save
    # (no dropout): the process RNGs would still hold the saved states.
    seed_process_rngs(ckpt.cfg.seed + 1, ckpt.mesh.dp.rank)
    loaded_step = ckpt.load(ckpt.root / checkpoint.step_dir_name(step), model, optimizer)
    restored_tensors, restored_state = ckpt.state(loaded_step, optimizer, rank_state.get("skipped_batches", 0))
    mismatches = []
    for key in sorted(tensors):
        if _bytes(tensors[key]) != _bytes(restored_tensors[key]):
            mismatches.append(f"{key} differs")
    if _bytes(params) != _bytes(optimizer.params_snapshot()):
        mismatches.append("model parameters differ")
    if rank_state != json.loads(json.dumps(restored_state)):
        mismatches.append("step, data position or python/numpy RNG differ")
    expected, drawn = saved_rng_draws(tensors, rank_state["rng"]), process_rng_draws()
    mismatches += [f"{name} RNG draws differ after the restore" for name in expected
                   if expected[name] != drawn[name]]
    reports = agree.gather_bytes(json.dumps(mismatches).encode(), ckpt.comm)
    every = [f"rank {r}: {m}" for r, rep in enumerate(reports) for m in json.loads(rep)]
    return ResumeCheck(step, every)
