"""Train a GPT-style model (MiniGPT, GPT-2 or Llama: model=...) with DDP / ZeRO / tensor and pipeline
parallelism on torch.distributed.

    torchrun --nproc_per_node 4 train.py [overrides]   # one worker per process
    python train.py [overrides]                        # starts dist.world_size workers itself
    python train.py -m dist.world_size=1,2,4           # a Hydra sweep, one job per world size

Hydra composes conf/; this file checks the configuration, takes the run directory's lock, and
then either runs this process's rank (under torchrun or srun: ``distlib/launch/worker.py``) or
starts the job's workers (``distlib/launch/local.py``).
"""

from __future__ import annotations

import gc

# The imports below leave ~260,000 objects the collector tracks and almost no garbage among them
# (~7,000 objects in cycles), yet its passes over them (3 full, ~390 younger) took 0.45-0.65 s of
# each rank's start with 4 ranks on 2 cores (timed with gc.callbacks). So the collector is off
# until the imports are done; then what they created is frozen (never scanned again; 0.8 MB of
# that garbage stays) and collection resumes for what the run allocates: 0.02 s per rank.
gc.disable()
import os

# numpy's OpenBLAS starts a pool thread as it loads (torch imports numpy), which the run never uses
# (its math is torch's); without it the launcher runs no thread until its agent starts, so the fork
# server its workers come from can be a fork of it instead of a fresh interpreter importing torch
# again (distlib/launch/prefork.py). A value already set is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from distlib.app.checkpointing import init_from
from distlib.app.checkpointing.loader import refuse_fresh_run_over_checkpoints
from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.data import corpus as data
from distlib.app.data.tokens import DataError
from distlib.app.model import recompute
from distlib.app.runtime import launcher_env
from distlib.checkpoint.sharded import CheckpointError
from distlib.launch import continuation, hosts, hydra_config, local, run_lock, slurm, worker
from distlib.launch.torchrun import (
    UNDER_TORCHRUN,
    config_from_rank0,
    rank0_composes,
    record_error,
    restart_config,
    share_config,
    worker_argv,
)

gc.freeze()
gc.enable()

if TYPE_CHECKING:
    from omegaconf import DictConfig

_DEFERS_FILES = False  # this process writes Hydra's files itself, once the run may start (hydra_config)
_RUN_DIR_GIVEN: tuple[str, bool] | None = None  # hydra.run.dir as given, and whether it existed then
_ARGV: tuple[str, ...] = ()  # the command line as typed (node 0 publishes it for the other hosts)


def _refuse(line: str, code: int) -> None:
    """A start refused before the run began: its one line (for torchrun also its root cause), the
    directory Hydra made for it removed again when empty, and exit ``code``."""
    if code:
        record_error(line)
    hydra_config.drop_empty_run_dir(_RUN_DIR_GIVEN)
    print(line, file=sys.stderr)
    sys.exit(code)


def checked_config(tree: dict) -> RunConfig:
    """The run's configuration from Hydra's composed ``tree``, every key checked (and the data source
    looked at, and on a fresh start ``model.init_from``'s config) before any worker starts; a bad
    value is one ``config error: <key> ...`` line and exit status 2."""
    try:
        run_cfg = RunConfig.from_dict(tree)
        data.check_source(run_cfg)
        init_from.check_source(run_cfg)
    except (ConfigError, DataError) as exc:
        _refuse(f"config error: {exc}", 2)
    return run_cfg


def completed(tree: dict, overrides: list[str], run_dir: Path) -> dict:
    """``tree`` with what the run knows filled in where ``overrides`` leave it (model.init_from's
    architecture on a fresh start, the tokenizer's vocabulary: ``hydra_config.complete``); a
    model.init_from that is no model directory is one ``config error`` line and exit status 2."""
    try:
        return hydra_config.complete(tree, overrides, continuation.starts_fresh(tree, run_dir))
    except ConfigError as exc:
        _refuse(f"config error: {exc}", 2)


def _claim(run_cfg: RunConfig, run_dir: Path) -> None:
    """This job's lock on its run (and checkpoint) directory, or one line naming the holder."""
    try:
        run_lock.hold(run_dir, run_dir / run_cfg.checkpoint.dir)
    except run_lock.BusyError as exc:
        _refuse(f"error: {exc}", 1)


def _other_job(run_cfg: RunConfig, run_dir: Path) -> str | None:
    """The refusal naming the job that holds this run's directories, if one does (nothing written)."""
    try:
        run_lock.refuse_if_held(run_dir, run_dir / run_cfg.checkpoint.dir)
    except run_lock.BusyError as exc:
        return str(exc)
    return None


def _refuse_nothing_to_train(tree: dict, run_cfg: RunConfig, run_dir: Path) -> None:
    """A resume at or past ``train.steps`` would train nothing: one line, exit 0, nothing written."""
    done = continuation.finished(tree, run_dir)
    if done:
        busy = _other_job(run_cfg, run_dir)  # a job still training there: its steps are not done
        _refuse(f"error: {busy}", 1) if busy else _refuse(done, 0)


def _restart_resumes(tree: dict) -> dict:
    """A torchrun restart resumes the job's own checkpoints (continuation.resumed_on_restart);
    rank 0 says so in one line."""
    tree, line = continuation.resumed_on_restart(tree, launcher_env.attempt())
    if line and os.environ.get("RANK", "0") == "0":
        print(line, flush=True)
    return tree


def _launcher_problem(run_cfg: RunConfig) -> str | None:
    """dist.max_restarts and dist.nodes are this launcher's; torchrun and srun restart (or not) and
    place ranks on hosts by their own rules."""
    d = run_cfg.dist
    if not (UNDER_TORCHRUN or slurm.is_rank_task(os.environ)):
        return None
    if d.max_restarts:
        launcher = "torchrun: pass --max-restarts" if UNDER_TORCHRUN else "srun: requeue the job"
        return (
            f"dist.max_restarts={d.max_restarts} is python train.py's own launcher's "
            f"(it replaces a lost worker while the others stay); under {launcher} instead"
        )
    if d.nodes > 1:
        launcher = "torchrun: pass --nnodes" if UNDER_TORCHRUN else "srun: pass --nodes"
        return f"dist.nodes={d.nodes} is python train.py's own launcher's; under {launcher} instead"
    return None


def _auto_layout(tree: dict, overrides: list[str]) -> dict:
    """dist.layout=auto: the planner's layout in ``tree`` (distlib/launch/auto_layout.py), said in
    one line; python train.py's launcher only (torchrun and srun start every rank as given)."""
    if UNDER_TORCHRUN or slurm.is_rank_task(os.environ):
        _refuse(
            "config error: dist.layout=auto is chosen by python train.py's launcher before it starts the "
            "workers; here every rank starts as given: run scripts/plan.py and pass its overrides",
            2,
        )
    from distlib.launch import auto_layout

    try:
        tree, line = auto_layout.choose(tree, overrides)
    except ConfigError as exc:
        _refuse(f"config error: {exc}", 2)
    print(line, flush=True)
    return tree


def run_config(cfg: DictConfig) -> None:
    """Hydra's task: check, claim the run directory, then train (this rank) or start the workers."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=True)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    # a resume into a run that recorded its config continues with that config (continuation.py)
    overrides = list(HydraConfig.get().overrides.task)
    resumed = continuation.continued(tree, run_dir, overrides)
    tree = resumed[0] if resumed else tree
    # a continuation's tree was also set by its record's overrides
    tree = completed(tree, overrides + (continuation.recorded_overrides(run_dir) if resumed else []), run_dir)
    if UNDER_TORCHRUN:
        tree = _restart_resumes(tree)
    if tree["dist"]["layout"] == "auto":
        tree = _auto_layout(tree, overrides)
    run_cfg = checked_config(tree)
    problem = continuation.resume_path_problem(tree) or _launcher_problem(run_cfg)
    if problem:
        _refuse(f"config error: {problem}", 2)
    try:
        refuse_fresh_run_over_checkpoints(run_dir / run_cfg.checkpoint.dir, run_cfg.checkpoint.resume)
    except CheckpointError as exc:
        # a busy directory's checkpoints are another job's: then the reason given is that job
        _refuse(f"error: {_other_job(run_cfg, run_dir) or exc}", 1)
    _refuse_nothing_to_train(tree, run_cfg, run_dir)
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        _claim(run_cfg, run_dir)
    if _DEFERS_FILES and resumed:
        if resumed[1]:  # what this continuation changed, beside the run's own record
            continuation.save_record(run_dir, tree, resumed[1])
    elif _DEFERS_FILES:
        hydra_config.save_files(cfg, run_dir, tree)
    if UNDER_TORCHRUN:
        if rank0_composes(sys.argv):
            share_config(tree, str(run_dir))
        worker.run(tree, str(run_dir))
    elif slurm.is_rank_task(os.environ):
        # srun with several tasks (scripts/train.sbatch, or hydra/launcher=submitit_slurm with
        # several tasks per job): every task is one rank (distlib/launch/slurm.py)
        try:
            os.environ.update(slurm.torch_env(os.environ))
        except slurm.SlurmEnvError as exc:
            sys.exit(f"error: {exc}")
        worker.run(tree, str(run_dir))
    else:
        # the workers train this checked config under torch's agent; Hydra's files are this process's
        preload = recompute.imports(run_cfg.model.activation_checkpointing)
        d = run_cfg.dist
        local.launch(
            tree,
            d.world_size,
            str(run_dir),
            run_cfg.metrics.file,
            preload,
            d.max_restarts,
            d.timeout_s,
            d.standbys,
            _hosts(run_cfg),
        )


def _hosts(run_cfg: RunConfig) -> hosts.Hosts:
    """Node 0's place in a job over several hosts (``dist.nodes``); a one-host job's otherwise."""
    from distlib.app.config.operation import store_address

    d = run_cfg.dist
    if d.nodes == 1:
        return hosts.Hosts()
    return hosts.Hosts(d.nodes, 0, store_address(d.store), _ARGV)


def _submitit_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:  # not even the hydra_plugins namespace exists
        return False


def main() -> None:
    """Hydra composes conf/ with the command line and calls ``run_config``. Imported here, not at
    the top: under torchrun the other ranks never need Hydra (see ``rank0_composes``)."""
    if any(a.startswith("hydra/launcher=submitit") for a in sys.argv[1:]) and not _submitit_installed():
        # Hydra would fail with a traceback ending in "Unknown plugin class".
        sys.exit(
            "error: hydra/launcher=submitit_slurm needs the optional plugin, which is not installed: "
            'pip install hydra-submitit-launcher (docs/beyond.md, "SLURM")'
        )
    own_launcher = not UNDER_TORCHRUN and not slurm.is_rank_task(os.environ)
    problem = local.temp_dir_problem() if own_launcher else None
    if problem:
        sys.exit(f"error: {problem}")  # before anything is written
    try:
        follower = hosts.follower(list(_ARGV)) if own_launcher else None
    except hosts.HostError as exc:
        exc.leave()
    if follower:  # a host other than node 0: node 0 composes, this one takes its configuration
        local.follow(list(_ARGV), *follower)
        return
    import hydra

    global _RUN_DIR_GIVEN
    _RUN_DIR_GIVEN = hydra_config.given_run_dir(sys.argv[1:])
    wrong = hydra_config.missing_choice(sys.argv[1:])
    if wrong:
        _refuse(f"config error: {wrong}", 2)
    hydra_config.register()  # every key's default, from the config dataclasses
    hydra.main(version_base="1.3", config_path="conf", config_name="config")(run_config)()


if __name__ == "__main__":
    _ARGV = tuple(sys.argv[1:])
    if UNDER_TORCHRUN:
        worker.die_with_parent()  # a launcher killed even by SIGKILL leaves no worker training on
        sys.argv = worker_argv(sys.argv)
    elif slurm.is_rank_task(os.environ):
        # `srun -n N python train.py`: all tasks must share one run directory (the same across a
        # requeue of the job), and only task 0 writes Hydra's files into it.
        sys.argv += slurm.hydra_args(os.environ, sys.argv[1:])
    if hydra_config.defers_files(sys.argv, os.environ.get("RANK", "0")):
        _DEFERS_FILES = True
        sys.argv.append(hydra_config.NO_SUBDIR)
    restart = restart_config() if rank0_composes(sys.argv) else None
    if restart:  # a restart: the first start's config, no Hydra; rank 0 claims the run directory again
        tree, run_dir = _restart_resumes(restart[0]), restart[1]
        if os.environ["RANK"] == "0":
            _claim(RunConfig.from_dict(tree), Path(run_dir))
        worker.run(tree, run_dir)
    elif rank0_composes(sys.argv) and os.environ.get("RANK", "0") != "0":
        worker.run(*config_from_rank0())
    else:
        main()
    # The run is over: files are closed and stdio is flushed by the interpreter regardless. Its
    # last garbage collection would walk every object created since the freeze above (Hydra's,
    # the model's); freezing them too skips that walk.
    gc.freeze()
