"""Finding the checkpoint to resume from, and loading one: verified, fitted, then restored.

``resolve`` turns ``checkpoint.resume`` into a path: an explicit checkpoint (exactly that one, or
the run fails), ``latest`` (the newest committed checkpoint that verifies; damaged newer ones are
moved aside and named), or none. ``load`` verifies a checkpoint (the ranks hash its files between
them and share the verdict), checks its run configuration and that it fits this run (``fit_check``:
every difference listed), and only then restores this rank's optimizer partition (by parameter name
and global slice from a checkpoint of any layout: ``checkpoint.relayout``), parameters, RNG and
data position.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from distlib.app.checkpointing import state_buffers as buffers
from distlib.app.checkpointing.fit_check import check_fits
from distlib.app.checkpointing.manifest_config import NO_RESUME, manifest_config
from distlib.app.checkpointing.rng import seed_process_rngs
from distlib.app.config.run import RunConfig
from distlib.app.data.batches import GlobalBatches
from distlib.app.model.bias_balance import state_buffers, state_names
from distlib.app.runtime import launcher_env
from distlib.checkpoint import relayout, rng_state
from distlib.checkpoint import sharded as checkpoint
from distlib.comm import agree
from distlib.comm.group import Comm
from distlib.comm.layout import NAMES, Layout
from distlib.comm.mesh import Mesh
from distlib.parallel.zero import ZeroOptimizer


class Loader:
    def __init__(
        self,
        cfg: RunConfig,
        comm: Comm,
        mesh: Mesh,
        data: GlobalBatches,
        root: Path,
        say: Callable[[str], None],
        splits: dict | None = None,
    ):
        self.cfg, self.comm, self.mesh, self.data, self.root, self.say = cfg, comm, mesh, data, root, say
        self.splits = splits or {}  # this rank's tensor-parallel cuts, parameter name -> Split

    def resolve(self) -> tuple[Path | None, bool]:
        """(checkpoint to resume from or None, whether it has been verified already). For "latest",
        the ranks verify the candidates together, newest first; damaged ones are moved aside."""
        resume = self.cfg.checkpoint.resume
        if self.restarting_from_path():
            return self._continued(Path(resume))
        if resume not in NO_RESUME and resume != "latest":
            return Path(resume), False
        candidates = self._committed()
        if resume != "latest":
            if candidates:
                raise fresh_run_collision(self.root, candidates[-1])
            return None, False
        found, damaged = self._newest_sound(candidates)
        if found is None:
            if damaged:
                raise checkpoint.CheckpointError(
                    f"checkpoint.resume=latest: none of the {len(damaged)} checkpoint(s) in {self.root} "
                    f"verifies; the newest: {damaged[0][1]}"
                )
            self.say(f"resume: no checkpoint in {self.root}; starting fresh")
            return None, False
        self._set_aside(damaged)
        self.say(f"resume: latest valid checkpoint is {found}")
        return found, True

    def _set_aside(self, damaged: list[tuple[Path, str]]) -> None:
        if self.comm.rank == 0:
            for bad, problem in damaged:
                # Moved aside, not deleted: kept for inspection, and the rerun can save that step again.
                print(
                    f"resume: skipping a damaged checkpoint (moved to {checkpoint.quarantine(bad)}): "
                    f"{problem}",
                    file=sys.stderr,
                    flush=True,
                )

    def restarting_from_path(self) -> bool:
        """A restart of a job that began from an explicit checkpoint: it continues what the job itself
        saved since (its memory snapshots, then its newest checkpoint), not that first checkpoint
        again, which would throw away every step since."""
        resume = self.cfg.checkpoint.resume
        return launcher_env.attempt() > 0 and resume not in NO_RESUME and resume != "latest"

    def _continued(self, begun: Path) -> tuple[Path, bool]:
        """The job's newest sound checkpoint saved after ``begun``, else ``begun`` itself."""
        try:
            after = int(checkpoint.read_manifest(begun)["step"])  # (its name may be any)
        except checkpoint.CheckpointError:  # gone since the first start: what the job saved still counts
            after = -1
        found, damaged = self._newest_sound([p for p in self._committed() if _step_of(p) > after])
        self._set_aside(damaged)
        if found is None:
            return begun, False
        self.say(
            f"resume: restart {launcher_env.attempt()} of the job: continuing from its own {found} "
            f"(checkpoint.resume={begun} is where its first start began)"
        )
        return found, True

    def _committed(self) -> list[Path]:
        listing = agree.agreed(
            lambda: [str(p) for p in checkpoint.list_committed(self.root)],
            self.comm,
            checkpoint.CheckpointError,
            rank0_only=True,
        )
        return [Path(p) for p in listing]

    def _newest_sound(self, candidates: list[Path]) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest candidate every rank verified, and the damaged ones newer than it."""
        damaged = []
        for path in reversed(candidates):
            try:
                checkpoint.verify_collectively(path, self.comm)
            except checkpoint.CheckpointError as exc:
                damaged.append((path, str(exc)))
                continue
            return path, damaged
        return None, damaged

    def load(
        self, path: Path, model, optimizer: ZeroOptimizer, verified: bool = False, restores_data: bool = True
    ) -> int:
        """Load ``path`` into ``optimizer`` (which updates ``model``): nothing is loaded unless all of it
        fits. ``restores_data``: also set the run's data position (not for a second, checking
        optimizer). Returns the checkpoint's step."""
        path = Path(path)
        if not verified:
            checkpoint.verify_collectively(path, self.comm)
        manifest = agree.agreed(lambda: _read_checked(path), self.comm, checkpoint.CheckpointError)
        mesh = self.mesh
        held = optimizer.partitions()
        check_fits(path, manifest, [p.layout for p in held], self.splits, self.cfg, self.data)
        stage, stages = (mesh.pp.rank, mesh.pp.size) if mesh.pp else (0, 1)
        places = {
            p.prefix: relayout.Place(
                p.layout, p.rank, p.layout.world_size, self.splits, stage, stages, mesh.tp.rank, mesh.tp.size
            )
            for p in held
        }
        state, rank_state, rng = agree.agreed(
            lambda: relayout.load(path, manifest, places), self.comm, checkpoint.CheckpointError
        )
        optimizer.load_state_shard(state, rank_state["optimizer_steps"])
        found = agree.agreed(
            lambda: buffers.load(path, manifest, state_buffers(model)), self.comm, checkpoint.CheckpointError
        )
        if not found and state_names(self.cfg.model):
            self.say(f"{path} holds no expert biases (saved with model.balance=aux): they start at zero")
        if rng is not None:
            rng_state.restore_rng(rng, rank_state["rng"])
            rng_state.restore_device_rng(rng, optimizer.device)
        else:
            seed_process_rngs(self.cfg.seed, mesh.dp.rank)
        if restores_data:
            self.data.skipped = int(manifest.get("skipped_batches", 0))
        self._say_what_changed(path, manifest, rng is not None)
        return int(manifest["step"])

    def _say_what_changed(self, path: Path, manifest: dict, had_rng: bool) -> None:
        """Another layout and re-seeding are told (one line each; the RNG question is collective)."""
        reseeded = [r for r, (had,) in enumerate(agree.gather([float(had_rng)], self.comm)) if not had]
        saved, ours = _degrees(Layout.of_manifest(manifest)), _degrees(self.mesh.layout)
        if manifest["world_size"] != self.comm.size or saved != ours:
            self.say(
                f"resharded checkpoint {path}: saved by {manifest['world_size']} rank(s) at ZeRO stage "
                f"{manifest.get('zero_stage')} ({saved}), loaded into {self.comm.size} at stage "
                f"{self.cfg.zero.stage} ({ours}) by parameter name; the data position carries over "
                f"(same global batch, {self.cfg.global_batch})"
            )
        if reseeded:
            self.say(
                f"rank(s) {reseeded} have no saved RNG state in {path} (no rank at their place: it was "
                f"saved by fewer ranks or at another pipeline or tensor-parallel degree): re-seeded from "
                f"seed + rank (dropout masks do not depend on it: they are keyed by sample)"
            )


def _degrees(layout: Layout) -> str:
    """``layout``'s degrees above 1 ("pp 2 x dp 2"), or "one rank"."""
    sizes = {name: getattr(layout, name) for name in NAMES}
    return " x ".join(f"{n} {k}" for n, k in sizes.items() if k > 1) or "one rank"


def _read_checked(path: Path) -> dict:
    """The manifest at ``path``, its run configuration checked like a run's own."""
    manifest = checkpoint.read_manifest(path)
    manifest_config(manifest, path)
    return manifest


def _step_of(path: Path) -> int:
    """The step of one of the run's own checkpoints, by its name (``step_00000040``)."""
    return int(path.name[len("step_") :])


def fresh_run_collision(root: Path, newest: Path) -> checkpoint.CheckpointError:
    """A fresh run into ``root`` would collide with (and never overwrite) its checkpoints."""
    return checkpoint.CheckpointError(
        f"{root} already holds checkpoint(s) up to {newest.name}; pass checkpoint.resume=latest to "
        f"continue that run, or choose a new hydra.run.dir"
    )


def refuse_fresh_run_over_checkpoints(root: Path, resume: str | None) -> None:
    """Before anything is written (train.py calls it before Hydra's files): a run that does not
    resume must not start in a directory that already holds committed checkpoints."""
    if resume in NO_RESUME:
        committed = checkpoint.list_committed(root)
        if committed:
            raise fresh_run_collision(root, committed[-1])
