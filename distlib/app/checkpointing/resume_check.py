"""Invariant 4, the resume check: reload a checkpoint of this run into a freshly built model and
optimizer and compare every restored byte, and what the restored generators draw.

``ResumeVerifier`` keeps the state of the checkpoint it will reload (``keep``: the tensors and
rank state written, and the parameter bytes at the save) -- the run's first checkpoint, or with
``checkpoint.keep_last`` the newest (retention may delete the first) -- and at the end of the run
(``verify``) loads that checkpoint through the run's own ``Loader`` into a model and optimizer
built from a different seed, with the process RNGs re-seeded differently.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from distlib.app.checkpointing.contents import Contents
from distlib.app.checkpointing.loader import Loader
from distlib.app.checkpointing.rng import process_rng_draws, saved_rng_draws, seed_process_rngs
from distlib.app.model.bias_balance import state_buffers
from distlib.checkpoint import sharded as checkpoint
from distlib.comm import agree
from distlib.comm.group import Comm
from distlib.parallel.zero import ZeroOptimizer


@dataclass
class ResumeCheck:
    step: int
    mismatches: list[str]  # "rank R: what differed"; empty means byte-identical

    @property
    def ok(self) -> bool:
        return not self.mismatches


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()


@dataclass
class Kept:
    """What a save wrote on this rank, and the parameter bytes at the save."""

    step: int
    tensors: dict[str, torch.Tensor]
    rank_state: dict
    params: torch.Tensor


class ResumeVerifier:
    def __init__(
        self,
        enabled: bool,
        every_save: bool,
        seed: int,
        dp_rank: int,
        comm: Comm,
        root: Path,
        loader: Loader,
        contents: Contents,
    ):
        self.enabled, self.every_save, self.seed, self.dp_rank = enabled, every_save, seed, dp_rank
        self.comm, self.root, self.loader, self.contents = comm, root, loader, contents
        self.kept: Kept | None = None

    def wants(self) -> bool:
        """Whether the next save is to be kept: the first one, or (``every_save``) each one."""
        return self.enabled and (self.kept is None or self.every_save)

    def keep(self, kept: Kept) -> Kept | None:
        """Keep ``kept`` for the check; returns the one it replaces (its tensors are free again)."""
        previous, self.kept = self.kept, kept
        return previous

    def forget_after(self, step: int) -> None:
        """A rollback to ``step``: a kept save of a later step belongs to the abandoned run."""
        if self.kept is not None and self.kept.step > step:
            self.kept = None

    def verify(self, build: Callable[[], tuple[torch.nn.Module, ZeroOptimizer]]) -> ResumeCheck | None:
        """Reload the kept save's checkpoint into ``build()``'s fresh model and optimizer (one initialised
        from a different seed) and compare every restored byte with what was saved, and what the
        restored generators draw with what the saved ones draw (collective). None: nothing to check."""
        if self.kept is None or not self.enabled:
            return None
        kept = self.kept
        model, optimizer = build()
        # Without this a restore that does nothing would pass whenever nothing drew since the save
        # (no dropout): the process RNGs would still hold the saved states.
        seed_process_rngs(self.seed + 1, self.dp_rank)
        path = self.root / checkpoint.step_dir_name(kept.step)
        loaded_step = self.loader.load(path, model, optimizer, restores_data=False)
        # the fresh model's buffers, as loaded (the run's own have moved on since the save)
        restored, restored_state = self.contents.state(
            loaded_step, optimizer, kept.rank_state.get("skipped_batches", 0), buffers=state_buffers(model)
        )
        mismatches = [
            f"{key} differs"
            for key in sorted(kept.tensors)
            if _bytes(kept.tensors[key]) != _bytes(restored[key])
        ]
        if _bytes(kept.params) != _bytes(optimizer.params_snapshot()):
            mismatches.append("model parameters differ")
        if kept.rank_state != json.loads(json.dumps(restored_state)):
            mismatches.append("step, data position or python/numpy RNG differ")
        expected, drawn = saved_rng_draws(kept.tensors, kept.rank_state["rng"]), process_rng_draws()
        mismatches += [
            f"{name} RNG draws differ after the restore" for name in expected if expected[name] != drawn[name]
        ]
        reports = agree.gather_bytes(json.dumps(mismatches).encode(), self.comm)
        return ResumeCheck(
            kept.step, [f"rank {r}: {m}" for r, rep in enumerate(reports) for m in json.loads(rep)]
        )
