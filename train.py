"""Train a GPT-style model (MiniGPT, GPT-2 or Llama: model=...) with DDP / ZeRO on torch.distributed.

    torchrun --nproc_per_node 4 train.py [overrides]   # one worker per process
    python train.py [overrides]                        # starts dist.world_size workers itself
    python train.py -m dist.world_size=1,2,4           # a Hydra sweep, one job per world size

Hydra composes conf/; this file only wires the pieces in distlib/ together.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from distlib.app import summary
from distlib.app.checkpointing import init_from
from distlib.app.checkpointing.loader import refuse_fresh_run_over_checkpoints
from distlib.app.config.run import ConfigError, RunConfig
from distlib.app.data import batches as data
from distlib.app.data.tokens import DataError
from distlib.app.faults import step_hooks
from distlib.app.hooks import StepHooks
from distlib.app.observe.metrics import last_event
from distlib.app.trainer import Trainer
from distlib.app.unattended.guard import DesyncError, GuardError
from distlib.checkpoint.sharded import CheckpointError
from distlib.comm.group import Comm
from distlib.comm.p2p import CollectiveMismatchError
from distlib.comm.watchdog import StallError
from distlib.launch import slurm
from distlib.launch.torchrun import (
    UNDER_TORCHRUN,
    StartError,
    config_from_rank0,
    init_process_group,
    join_job_start,
    rank0_composes,
    share_config,
    shared_run_dir,
    use_cuda_device,
    use_deterministic_kernels,
    wait_for_siblings,
)

if TYPE_CHECKING:
    from omegaconf import DictConfig


@record
def worker(tree: dict, run_dir: str) -> None:
    """One rank. Known failures (bad config, damaged checkpoint, a guard or desync stop, a stalled
    or mismatched collective) print one line and exit 1 (once, from rank 0, when the ranks agreed
    on the error first); anything else keeps its traceback."""
    rank = os.environ.get("RANK", "?")
    try:
        failures, stopped_by = _train(RunConfig.from_dict(tree), run_dir)
    except (ConfigError, CheckpointError, DataError, StallError) as exc:
        print(f"error [rank {rank}]: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    if failures:
        sys.exit(1)
    if stopped_by and not UNDER_TORCHRUN:
        # Our own launcher is shutting down after forwarding the signal: a returning fork worker would
        # wait for it to collect results it no longer collects, until SIGKILL. Leave now, cleanly.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _train(cfg: RunConfig, run_dir: str) -> tuple[list[str], str | None]:
    """Join the process group, train, report; returns the broken invariants (every rank agrees)
    and the signal that stopped the run early, if one did."""
    torch.set_num_threads(1)
    use_deterministic_kernels()
    device = cfg.device(int(os.environ.get("LOCAL_RANK", "0")))
    if device != "cpu":
        use_cuda_device(device)
    # Fault injection (distlib/app/faults.py) attaches from outside the loop; none configured: no-op hooks.
    hooks = step_hooks(cfg.fault, int(os.environ.get("RANK", "0")))
    _join(cfg, hooks, device)
    failures, rank, stopped_by = [], dist.get_rank(), None
    try:
        # NCCL moves messages between GPUs; gloo between hosts (CUDA tensors are staged through them).
        comm = Comm.world(device=device if cfg.dist.backend == "nccl" else "cpu")
        if comm.size != cfg.dist.world_size:
            raise ConfigError(
                f"dist.world_size={cfg.dist.world_size} but {comm.size} processes were started; "
                f"pass dist.world_size={comm.size} (or start {cfg.dist.world_size} processes)"
            )
        result = Trainer(cfg, comm, Path(run_dir), hooks=hooks, device=device).run()
        failures = summary.check_invariants(result, cfg.train.loss_tolerance, cfg.train.monotone_until_step)
        if comm.rank == 0:
            summary.write_json(result, failures, Path(run_dir) / "report.json")
            print(f"run directory: {run_dir}")
            print(summary.loss_table(result))
            print(summary.memory_table(result, cfg.zero.stage))
            for manifest in result.manifests[:1]:
                print(summary.manifest_text(manifest))
            if result.stopped_by:
                print(
                    f"stopped by {result.stopped_by} after step "
                    f"{result.steps[-1].step if result.steps else 0}: "
                    f"checkpoint saved; continue with checkpoint.resume=latest"
                )
            elif result.resume_check is None:
                print(
                    "resume check: not run (no checkpoint saved in this run, "
                    "or checkpoint.verify_resume=false)"
                )
            elif result.resume_check.ok:
                print(
                    f"step-{result.resume_check.step} checkpoint reloaded byte-identical on all "
                    f"{comm.size} ranks"
                )
                print("RESUME VERIFIED")
            for failure in failures:
                print(f"INVARIANT FAILED: {failure}", file=sys.stderr)
            sys.stdout.flush()
        stopped_by = result.stopped_by
    except (CheckpointError, ConfigError, DataError, GuardError, DesyncError, CollectiveMismatchError) as exc:
        # Raised on every rank alike (they agree on it first): one line, not one per rank.
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        failures = [str(exc)]
    except StallError as exc:
        # Each rank that waited names what it waited for, now: the first of them to exit makes
        # torchrun SIGTERM the others, and one still tearing its group down (no handler of ours
        # left) would die without its line.
        print(f"error [rank {rank}]: {exc}", file=sys.stderr, flush=True)
        failures = [str(exc)]
    finally:
        dist.destroy_process_group()
    return failures, stopped_by


def _join(cfg: RunConfig, hooks: StepHooks, device: str = "cpu") -> None:
    """The rendezvous, under dist.timeout_s; a rank that never arrives is named. Any other failure
    (a bad address, a port in use) keeps its own message: it is not a rank that did not arrive."""
    hooks.joining()
    try:
        init_process_group(cfg.dist.backend, datetime.timedelta(seconds=cfg.dist.timeout_s), device)
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds; only a timeout is re-worded
        # torch tells a timeout only in the text: DistStoreError "wait timeout after ...", "Timed out
        # initializing ...", a client socket that "has timed out"
        if not (
            isinstance(exc, TimeoutError)
            or isinstance(exc, RuntimeError)
            and re.search(r"\btime(d)?[ -]?out\b", str(exc), re.IGNORECASE)
        ):
            raise
        # torch names the store keys it waited for; each ends in the rank that never wrote it
        missing = sorted({int(k) for k in re.findall(r"/(\d+)(?=,|\s|$)", str(exc).partition("keys:")[2])})
        who = f"rank(s) {missing} did not arrive" if missing else "a rank did not arrive"
        raise StallError(
            f"rendezvous: the process group of {cfg.dist.world_size} ranks did not form within "
            f"dist.timeout_s={cfg.dist.timeout_s:g}s: {who} ({exc})"
        ) from exc


def _forked_worker(tree: dict, run_dir: str, world_size: int) -> None:
    wait_for_siblings(world_size)  # no store traffic while the launcher still forks (torchrun.py)
    worker(tree, run_dir)


def _launch(tree: dict, run_dir: str, world_size: int) -> None:
    """Start ``world_size`` workers through torch's elastic launcher (what torchrun uses). On
    SIGTERM/SIGINT the launcher forwards the signal; the workers finish their step, save and
    stop, and this process exits 0 if the run's log says they did (1 otherwise)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="fork",
    )
    # The workers print their own one-line errors; the agent's tracebacks would bury them.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    started = time.time()
    try:
        elastic_launch(config, _forked_worker)(tree, run_dir, world_size)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        end = last_event(Path(run_dir) / RunConfig.from_dict(tree).metrics.file, "run_end", since=started)
        if end and end["status"] == f"stopped by {name}":
            print(
                f"{name}: the workers saved a checkpoint at step {end['step']} and stopped; "
                f"continue with checkpoint.resume=latest hydra.run.dir={run_dir}",
                file=sys.stderr,
            )
            sys.exit(0)
        print(
            f"error: {name} received and the workers did not report a clean stop (see {run_dir})",
            file=sys.stderr,
        )
        sys.exit(1)
    except ChildFailedError as exc:
        failed = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(exc.failures.items()))
        print(f"error: training failed: {failed}", file=sys.stderr)
        for r, failure in sorted(exc.failures.items()):
            # worker() (@record) leaves an unexpected exception in torchelastic's error file; it is a bug,
            # so its traceback is printed too, as torchrun's workers do
            if isinstance(failure.message, dict) and "message" in failure.message:
                stack = failure.message.get("extraInfo", {}).get("py_callstack", "")
                print(f"rank {r}: {stack or failure.message['message']}".rstrip(), file=sys.stderr)
        sys.exit(1)


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
    import hydra

    from distlib.launch import hydra_config

    hydra_config.register()  # every key's default, from the config dataclasses
    hydra.main(version_base="1.3", config_path="conf", config_name="config")(run_config)()


# A refused run must leave its directory as it found it, but Hydra writes .hydra/ (config.yaml,
# hydra.yaml, overrides.yaml) before calling run_config. So a plain run asks Hydra for none
# (hydra.output_subdir=null, appended in __main__) and writes them itself once the config is valid
# and the run may start: the same three files, with output_subdir recorded as ".hydra".
_HYDRA_FILES_DEFERRED = False
_HYDRA_SUBDIR = ".hydra"


def _defer_hydra_files(argv: list[str]) -> bool:
    """Whether this process should write Hydra's files itself: a plain run (no -m or other Hydra
    flag), on rank 0, without an explicit hydra.output_subdir."""
    return (
        not any(a.startswith("-") for a in argv[1:])
        and os.environ.get("RANK", "0") == "0"
        and not any(a.startswith("hydra.output_subdir=") for a in argv[1:])
    )


def _save_hydra_files(cfg: DictConfig, run_dir: Path) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, flag_override

    hydra_cfg = OmegaConf.create(OmegaConf.to_container(HydraConfig.get()))  # a writable copy
    with flag_override(hydra_cfg, "readonly", False):
        hydra_cfg.output_subdir = _HYDRA_SUBDIR
        hydra_cfg.overrides.hydra = [o for o in hydra_cfg.overrides.hydra if o != "hydra.output_subdir=null"]
    out = run_dir / _HYDRA_SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    for name, node in (
        ("config.yaml", cfg),
        ("hydra.yaml", OmegaConf.create({"hydra": hydra_cfg})),
        ("overrides.yaml", hydra_cfg.overrides.task),
    ):
        (out / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")


def checked_config(tree: dict) -> RunConfig:
    """The run's configuration from Hydra's composed ``tree``, every key checked (and the data source
    looked at, and on a fresh start ``model.init_from``'s config) before any worker starts; a bad
    value is one ``config error: <key> ...`` line and exit status 2."""
    try:
        run_cfg = RunConfig.from_dict(tree)
        data.check_source(run_cfg)
        init_from.check_source(run_cfg)
    except (ConfigError, DataError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)
    return run_cfg


def run_config(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=True)
    run_cfg = checked_config(tree)
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        refuse_fresh_run_over_checkpoints(Path(run_dir) / run_cfg.checkpoint.dir, run_cfg.checkpoint.resume)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    if _HYDRA_FILES_DEFERRED:
        _save_hydra_files(cfg, Path(run_dir))
    if UNDER_TORCHRUN:
        if rank0_composes(sys.argv):
            share_config(tree, run_dir)
        worker(tree, run_dir)
    elif slurm.is_rank_task(os.environ):
        # srun with several tasks (scripts/train.sbatch, or hydra/launcher=submitit_slurm with
        # several tasks per job): every task is one rank (distlib/launch/slurm.py)
        try:
            os.environ.update(slurm.torch_env(os.environ))
        except slurm.SlurmEnvError as exc:
            sys.exit(f"error: {exc}")
        worker(tree, run_dir)
    else:
        _launch(tree, run_dir, run_cfg.dist.world_size)


if __name__ == "__main__":
    if UNDER_TORCHRUN:
        if any(arg in ("-m", "--multirun") for arg in sys.argv[1:]):
            sys.exit(
                "error: a Hydra sweep (-m) starts its own workers; run it with plain `python train.py -m ...`"
            )
        try:
            join_job_start()  # one key prefix and start number on every node (torchrun counts per node)
        except StartError as exc:
            sys.exit(f"error [rank {os.environ.get('RANK', '?')}]: {exc}")
        explicit = any(arg.startswith("hydra.run.dir=") for arg in sys.argv[1:])
        if not explicit:
            stamp = datetime.datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")
            sys.argv.append(f"hydra.run.dir={shared_run_dir(stamp)}")
        if not any(arg.startswith("dist.world_size=") for arg in sys.argv[1:]):
            sys.argv.append(f"dist.world_size={os.environ['WORLD_SIZE']}")  # torchrun decides
        if os.environ.get("RANK", "0") != "0":
            # Only rank 0 writes Hydra's shared files (.hydra/, the job log).
            sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    elif slurm.is_rank_task(os.environ):
        # `srun -n N python train.py`: all tasks must share one run directory (the same across a
        # requeue of the job), and only task 0 writes Hydra's files into it.
        sys.argv += slurm.hydra_args(os.environ, sys.argv[1:])
    if _defer_hydra_files(sys.argv):
        _HYDRA_FILES_DEFERRED = True
        sys.argv.append("hydra.output_subdir=null")
    if rank0_composes(sys.argv) and os.environ.get("RANK", "0") != "0":
        worker(*config_from_rank0())
    else:
        main()
    # The run is over: files are closed and stdio is flushed by the interpreter regardless. Its
    # last garbage collection would walk every object torch and Hydra created (~0.35 s per rank
    # here, on the capstone's critical path); freezing them skips that walk.
    gc.freeze()
