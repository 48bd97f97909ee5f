"""The config groups of how a run is operated: processes and layout, checkpoints, the guard.

Each key is declared once, here (``schema.key``); rules between groups are in ``run.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlib.app.config.schema import ConfigError, Group, key
from distlib.comm.group import COLLECTIVES, TRANSPORTS

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class DistConfig(Group):
    """Processes, transport and the parallel layout (world = data x tensor x pipeline ranks).

    world_size: processes: `.venv/bin/python train.py` starts this many; under torchrun it defaults to
        torchrun's world size, and an explicit value must match it
    backend: gloo (host transport; CUDA tensors are staged through pinned host memory) or nccl (needs CUDA
        and train.device cuda/auto)
    timeout_s: every collective and the rendezvous fail after this many seconds
    max_restarts: `.venv/bin/python train.py` replaces up to this many workers lost to a signal (SIGKILL,
        the OOM killer, a native crash) in one job: the other ranks keep their processes and re-form the
        group with the new worker, and every rank resumes from the newest snapshot or checkpoint (with
        checkpoint.memory_every_steps=1 no recorded step is redone); 0: a lost worker ends the job. Under
        torchrun, its --max-restarts restarts every worker instead
    standbys: with dist.max_restarts > 0, this many idle workers kept started (torch and the trainer
        imported, joined to the job's store, no model): a lost worker's place goes to one of them instead of
        a process forked once the loss is seen, and another is started in its place; 0: forked then
    nodes: hosts of one `.venv/bin/python train.py` job: the same command runs on each with its own
        dist.node_rank, and each host's agent starts world_size / nodes workers (global ranks node_rank x
        that onward), replaces its own lost workers while every other rank stays, and meets the others
        at dist.store (docs/unattended.md, "Several hosts"); under torchrun: its --nnodes
    node_rank: this host's place among dist.nodes (0: the host that composes the configuration, takes the
        run directory and serves dist.store; the others take both from it)
    store: HOST:PORT of the job's store when dist.nodes > 1: node 0 listens on PORT, every host connects
        to HOST (node 0's name or address as the others reach it); should node 0 be lost, the store moves to
        the next host and node 0's ranks with it
    tp: tensor-parallel degree: attention heads and the MLP split over this many ranks (divides world_size,
        model.n_heads, llama's model.n_kv_heads and the MLP width); ZeRO shards over the world_size / tp
        data-parallel ranks
    check_collectives: every collective carries a small header, so a size/dtype/kind mismatch between ranks
        is a clear error instead of a hang or silent truncation
    collectives: whose collectives every group runs: ours (distlib/comm/algorithms, on point-to-point
        messages) or torch (torch.distributed's all_reduce, reduce_scatter, all_gather, broadcast on the
        group's process group, e.g. NCCL's on GPUs); pipeline send/recv is the same either way
    transport: what carries our collectives' messages between the ranks of one host: shm (a shared-memory
        segment per group, distlib/comm/shm.py) or gloo (its TCP pairs over loopback); groups that span
        hosts, and the nccl backend, use the backend's own
    pp: pipeline stages: the blocks split into pp contiguous stages (embeddings with the first, the head and
        loss with the last); world_size = data x tp x pp
    pp_schedule: the order of the train.grad_accum micro-batches' forwards and backwards
    pp_virtual: model chunks per rank (interleaved only); model.n_layers must divide into pp x pp_virtual
        chunks
    cp: context-parallel degree: every sample's sequence split over this many ranks (rank r holds chunks r
        and 2cp-1-r of 2cp, so causal attention's work is even); gradients average over dp x cp; world_size =
        data x cp x tp (model.seq_len divisible by 2 x cp)
    cp_impl: how attention reaches the other ranks' tokens: alltoall (sequence shards <-> head shards, every
        rank attends the whole sequence for n_heads/(tp x cp) heads; the heads must divide) or ring (keys and
        values travel around the cp ranks, partial attention merged by log-sum-exp)
    sp: sequence parallelism inside tensor parallelism (Megatron's): between the tensor-parallel layers
        (norms, residual adds and dropout) each of the dist.tp ranks holds model.seq_len/tp tokens, not a
        copy of all of them (less activation memory); the same losses (needs dist.tp > 1)
    ep: expert parallelism (model.family=mixtral, qwen3_moe or deepseek_v3): each block's (routed)
        experts split over this many of the data x cp ranks (it divides them and model.n_experts), tokens
        sent to their experts' ranks and back by an all-to-all; checkpoints are the same as without it
        (they resume at any ep)
    layout: given (dist.tp, pp, cp, ep and zero.stage/overlap as set) or auto: `.venv/bin/python train.py`
        asks the planner (scripts/plan.py) before any worker starts for the layout predicted fastest
        (on this machine; on a GPU run, on the data sheet of the GPU nvidia-smi names) among those that fit
        dist.budget_gb, searching the keys the command line leaves unset, and prints it as the overrides
        that pin it (python train.py only: torchrun and srun start every rank with the command line as given)
    budget_gb: with dist.layout=auto, the bytes per rank (decimal GB) of model states and activations
        kept for backward the layout must fit in; null: any (on a GPU the planner knows: its memory); set
        with a given layout, it is refused
    """

    GROUP = "dist"
    world_size: int = key(4, ge=1)
    backend: str = key("gloo", choices=("gloo", "nccl"))
    timeout_s: float = key(60.0, gt=0)
    max_restarts: int = key(0, ge=0)
    standbys: int = key(0, ge=0)
    nodes: int = key(1, ge=1)
    node_rank: int = key(0, ge=0)
    store: str | None = key(None)
    tp: int = key(1, ge=1)
    check_collectives: bool = key(True)
    collectives: str = key("ours", choices=COLLECTIVES)
    transport: str = key("shm", choices=TRANSPORTS)
    pp: int = key(1, ge=1)
    pp_schedule: str = key("1f1b", choices=PP_SCHEDULES)
    pp_virtual: int = key(1, ge=1)
    cp: int = key(1, ge=1)
    cp_impl: str = key("alltoall", choices=("alltoall", "ring"))
    sp: bool = key(False)
    ep: int = key(1, ge=1)
    layout: str = key("given", choices=("given", "auto"))
    budget_gb: float | None = key(None, gt=0)

    def check(self) -> None:
        if self.standbys and not self.max_restarts:
            raise ConfigError(
                f"dist.standbys={self.standbys} keeps workers ready to replace lost ones, and "
                "dist.max_restarts=0 replaces none: set dist.max_restarts too"
            )
        self._check_nodes()
        if self.budget_gb is not None and self.layout != "auto":
            raise ConfigError(
                f"dist.budget_gb={self.budget_gb:g} bounds the layout dist.layout=auto picks, and "
                "dist.layout is given: add dist.layout=auto, or drop dist.budget_gb"
            )
        if self.pp_virtual > 1 and self.pp_schedule != "interleaved":
            raise ConfigError(
                f"dist.pp_virtual={self.pp_virtual} needs dist.pp_schedule=interleaved "
                f"(got {self.pp_schedule})"
            )

    def _check_nodes(self) -> None:
        if self.node_rank >= self.nodes:
            raise ConfigError(
                f"dist.node_rank={self.node_rank} is no host of dist.nodes={self.nodes} "
                f"(0 to {self.nodes - 1})"
            )
        if self.world_size % self.nodes:
            raise ConfigError(
                f"dist.world_size={self.world_size} does not split evenly over dist.nodes={self.nodes} "
                "hosts: every host starts the same number of workers"
            )
        if self.nodes == 1 and self.store is not None:
            raise ConfigError(
                f"dist.store={self.store} is where the hosts of a job with dist.nodes > 1 meet; with one "
                "host the launcher serves its own: drop it, or set dist.nodes"
            )
        if self.nodes > 1:
            store_address(self.store)


def store_address(store: str | None) -> tuple[str, int]:
    """``dist.store``'s (host, port); a ConfigError naming what is wrong with it."""
    host, _, port = (store or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"dist.store={store} is not HOST:PORT (node 0's name or address and a free port, "
            "e.g. dist.store=node0:29500): every host of dist.nodes > 1 needs it"
        )
    return host, int(port)


@dataclass(frozen=True)
class CheckpointConfig(Group):
    """When sharded checkpoints are saved, which one a run resumes from, and how saves run.

    dir: where checkpoints go: relative to the run directory, or absolute
    every_steps: save after every K-th step; 0 disables step-based saving
    every_minutes: also save when this many minutes passed since the last save (rank 0's clock decides for
        all ranks); 0 disables. SIGTERM/SIGINT/SIGUSR2 always save
    resume: null: start fresh (a torchrun restart of the job: latest); latest: the newest checkpoint in
        `dir` that verifies (damaged newer ones are reported and moved aside; none at all: start fresh);
        or a checkpoint path, loaded exactly or the run fails (the model and tokenization keys the command
        line leaves unset come from its manifest). Any other layout or ZeRO stage is loaded by parameter name
    verify_resume: at the end, reload the first checkpoint (with keep_last: the newest) into a fresh model
        and optimizer and compare every byte (invariant 4); null = on for a run with the capstone's model,
        data and learning (the demo's proof), off for others (it keeps a host copy of a shard and builds
        a second model and optimizer at the end)
    keep_last: after each committed save keep only the newest K checkpoints (with the guard on: once the
        next step passed it); 0 keeps all
    async_save: copy each rank's shard into reused host buffers and write, fsync, hash and commit it in a
        background thread; committed at a later step boundary once every rank's write succeeded
        (docs/checkpoints.md)
    memory_every_steps: every K steps also keep each rank's shard in /dev/shm (only the newest,
        sha256-checked; with several nodes a replica on the next node); a restart with resume=latest resumes
        from it; removed when the job ends; 0 disables
    """

    GROUP = "checkpoint"
    dir: str = key("checkpoints")
    every_steps: int = key(10, ge=0)
    every_minutes: float = key(30.0, ge=0)
    resume: str | None = key(None)
    verify_resume: bool | None = key(None)
    keep_last: int = key(0, ge=0)
    async_save: bool = key(False)
    memory_every_steps: int = key(0, ge=0)


@dataclass(frozen=True)
class GuardConfig(Group):
    """The divergence guard and rollback, the replica (desync) check, straggler detection.

    enabled: check every step for a non-finite loss or grad norm and for loss spikes; on a trip no update is
        applied and the run rolls back to the newest trusted checkpoint
    spike_factor: trip when the loss > spike_factor x the reference
    spike_window: reference = the mean of the last K accepted losses (fewer right after a (re)start; 1: the
        previous step's alone, which near convergence one noisy batch trips: every small preset did by
        step 700 on the synthetic corpus)
    skip_batches: batches the first rollback to a trusted state skips (0 replays the same data); each
        further trip back to the same state also skips every batch the failed attempt read
    max_rollbacks: rollbacks allowed per run; the next trip stops the run with one line saying what was tried
        (exit 1)
    check_sync_every: every K steps compare a sha256 per parameter across the ranks that must hold the same
        bytes; 0 disables
    straggler_factor: a rank busier (outside collectives) than factor x the median rank ...
    straggler_window: ... for this many steps in a row gets a `straggler` event naming it
    """

    GROUP = "guard"
    enabled: bool = key(True)
    spike_factor: float = key(2.0, gt=1)
    spike_window: int = key(10, ge=1)
    skip_batches: int = key(0, ge=0)
    max_rollbacks: int = key(3, ge=0)
    check_sync_every: int = key(10, ge=0)
    straggler_factor: float = key(1.5, gt=1)
    straggler_window: int = key(5, ge=1)
