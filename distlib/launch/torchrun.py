"""Process-group plumbing under torchrun, kept out of train.py.

torchrun's agent hosts a TCPStore at MASTER_ADDR:MASTER_PORT that outlives worker restarts.
The helpers here use it for three things every rank must agree on before training: the
run directory, the composed config (rank 0 runs Hydra, the others read it), and a key prefix
per restart attempt for the process group itself.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import uuid

import torch
import torch.distributed as dist

UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ
CONFIG_WAIT_S = (
    300.0  # how long the other ranks wait for rank 0's config (torchrun ends them sooner if it fails)
)
START_ENV = "DISTLIB_START"  # set by join_job_start(): this start's key prefix
ATTEMPT_ENV = (
    "DISTLIB_ATTEMPT"  # and its number, read by the application (distlib/app/runtime/launcher_env.py)
)


def rank_error(message: str) -> None:
    """``error [rank R]: message`` on stderr in one write. print() writes the text and its newline
    apart when stderr is unbuffered (PYTHONUNBUFFERED, common under launchers): two ranks failing
    at the same moment then shared one line, and the second rank's name was lost in it."""
    line = f"error [rank {os.environ.get('RANK', '?')}]: {message}"
    record_error(line)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def record_error(line: str) -> None:
    """The user's one-line error as this worker's torchelastic error file: torchrun then reports it
    as the root cause (instead of "To enable traceback see ..." under its own traceback). The first
    error a process records stands; outside torchrun's workers there is no such file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)


def use_deterministic_kernels() -> None:
    """torch.use_deterministic_algorithms(True) without its side trip: the public function also sets
    an inductor flag, which imports torch._inductor and torch._dynamo (~4 s per rank on this
    machine, for a compiler we never use). The ATen switch it then flips is the one that matters."""
    set_flag = getattr(torch._C, "_set_deterministic_algorithms", None)
    if set_flag is None:
        torch.use_deterministic_algorithms(True)
    else:
        set_flag(True)


def use_cuda_device(device: str) -> None:
    """Make ``device`` this process's GPU, with repeatable arithmetic: cuBLAS reads
    CUBLAS_WORKSPACE_CONFIG when it is first used, and with a fixed workspace (plus the
    deterministic algorithms above) a GPU run repeats bit for bit (PyTorch's reproducibility
    notes). Call before anything touches CUDA."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.cuda.set_device(torch.device(device))


def _agent_store(timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class StartError(RuntimeError):
    """The ranks of one start of the job could not agree that they are one start."""


def join_job_start(timeout_s: float = CONFIG_WAIT_S) -> tuple[str, int]:
    """(token, attempt): one key prefix and one start number shared by every rank of this start
    of the job, whatever each node's agent counted. Sets DISTLIB_START and DISTLIB_ATTEMPT.

    torchrun's TORCHELASTIC_RESTART_COUNT is counted per node: an agent whose own workers are
    still healthy when another node's agent comes back restarts them as a "membership change"
    without counting it (torch's SimpleElasticAgent._invoke_run). After node1 lost its workers,
    node1's new ranks said 1 and node0's said 0, looked for rank 0's config and for each other's
    gloo addresses under different key prefixes, and the restarted job hung until its timeouts
    (5 minutes). The rendezvous round that the agents share is not visible to
    workers (their store is a separate one that rank 0's agent hosts for all rounds).

    So the ranks agree through that store, in a way stale keys of dead starts cannot fool: rank 0
    publishes a fresh token as the leader; every other rank acknowledges the leader it reads
    (maybe a dead one first) with a fresh token of its own; rank 0 waits for all W-1
    acknowledgements under its token and publishes them; a rank is in when it finds its own token
    in its leader's list. The start number is rank 0's count of starts in that store (at least
    its agent's restart count, should the store be new)."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    ):  # no store before the group: torchrun's count
        return str(count), count
    token, attempt = agree_start(
        _agent_store(timeout_s), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), count, timeout_s
    )
    os.environ[START_ENV], os.environ[ATTEMPT_ENV] = token, str(attempt)
    return token, attempt


def agree_start(
    store: dist.Store, rank: int, world: int, restart_count: int, timeout_s: float
) -> tuple[str, int]:
    """join_job_start's handshake on a given store (see there)."""
    mine, deadline = uuid.uuid4().hex, time.monotonic() + timeout_s
    if rank == 0:
        attempt = max(store.add("distlib/starts", 1) - 1, restart_count)
        store.set("distlib/leader", mine)
        acks = [f"distlib/ack/{mine}/{r}" for r in range(1, world)]
        try:
            if acks:
                store.wait(acks, datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - the store raises several kinds for a timeout
            missing = [r for r, key in enumerate(acks, 1) if not store.check([key])]
            raise StartError(
                f"rank(s) {missing} of this start did not arrive within {timeout_s:g} s"
            ) from exc
        members = [token.decode() for token in store.multi_get(acks)] if acks else []
        store.set(f"distlib/go/{mine}", json.dumps({"attempt": attempt, "members": members}))
        return mine, attempt
    try:
        store.wait(["distlib/leader"], datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - as above
        raise StartError(f"rank 0 of this start did not arrive within {timeout_s:g} s") from exc
    acked = None
    while True:
        leader = store.get("distlib/leader").decode()
        if leader != acked:
            store.set(f"distlib/ack/{leader}/{rank}", mine)
            acked = leader
        go = f"distlib/go/{leader}"
        if store.check([go]):
            decided = json.loads(store.get(go))
            if mine in decided["members"]:
                return leader, int(decided["attempt"])
        if time.monotonic() > deadline:
            raise StartError(f"rank 0 of this start did not admit rank {rank} within {timeout_s:g} s")
        time.sleep(0.02)


def _start_key() -> str:
    """The key prefix of this start (join_job_start), else torchrun's per-node count."""
    return os.environ.get(START_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def init_process_group(
    backend: str, timeout: datetime.timedelta, device: str = "cpu", store: dist.Store | None = None
) -> None:
    """Join the group. torchrun's agent keeps one store for all restarts of a job and env://
    does not separate them (pytorch/pytorch#135712): a restarted group would read the dead
    group's gloo addresses. So each start gets its own key prefix (join_job_start); a launcher
    that prefixes its own passes its ``store``. With NCCL, ``device_id`` creates the
    communicators now (and those of every later subgroup), so the first batched point-to-point
    round of a group need not involve all its ranks."""
    bound = {"device_id": torch.device(device)} if backend == "nccl" else {}
    if store is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, **bound)
        return
    if store is None:
        store = dist.PrefixStore(f"distlib/attempt_{_start_key()}", _agent_store(timeout.total_seconds()))
    dist.init_process_group(
        backend,
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
        **bound,
    )


def rank0_composes(argv: list[str]) -> bool:
    """Under torchrun only rank 0 runs Hydra and hands the composed config to the others through
    torchrun's store: importing Hydra and composing cost ~0.3 CPU-s per rank, which four ranks on
    two cores pay in the start-up (benchmarks/startup.py). Hydra's own flags (--help, --cfg, ...),
    which print instead of running, and a job without that store keep Hydra on every rank."""
    return (
        UNDER_TORCHRUN
        and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"
        and not any(arg.startswith("-") for arg in argv[1:])
    )


def _config_key() -> str:
    return f"distlib/config/{os.environ['TORCHELASTIC_RUN_ID']}/attempt_{_start_key()}"


def _job_config_key() -> str:
    return f"distlib/config/{os.environ['TORCHELASTIC_RUN_ID']}/job"


def share_config(tree: dict, run_dir: str) -> None:
    """Rank 0's composed config, for the other ranks of this start and for every later start."""
    if os.environ.get("RANK", "0") == "0":
        store, shared = _agent_store(60), json.dumps({"tree": tree, "run_dir": run_dir})
        store.set(_config_key(), shared)
        store.compare_set(_job_config_key(), "", shared)


def restart_config() -> tuple[dict, str] | None:
    """On a restart of the job (the agreed start number > 0), the config its first start composed:
    every rank reads it at once instead of waiting for rank 0 to run Hydra again (~1 s of a
    restart's critical path here). None on the first start, or when none was shared."""
    if os.environ.get(ATTEMPT_ENV, "0") == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = _agent_store(60)
    if not store.check([_job_config_key()]):
        return None
    shared = json.loads(store.get(_job_config_key()))
    return shared["tree"], shared["run_dir"]


def config_from_rank0() -> tuple[dict, str]:
    """(tree, run_dir) as rank 0 composed them. If rank 0 fails first (a bad override), torchrun
    stops this rank; the timeout only guards against a rank 0 that neither shares nor exits."""
    try:
        shared = json.loads(_agent_store(CONFIG_WAIT_S).get(_config_key()))
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds; all mean the same here
        rank_error(
            f"rank 0 did not share the composed config within {CONFIG_WAIT_S:g} s "
            f"(see rank 0's output): {exc}"
        )
        sys.exit(1)
    return shared["tree"], shared["run_dir"]


def shared_run_dir(proposed: str) -> str:
    """The first rank to ask fixes the run directory for all of them (and for restarts of the
    same job) through torchrun's own store. That is the store of agent rank 0's node
    (MASTER_ADDR:MASTER_PORT, which every node must reach anyway for init_process_group), so
    this works across hosts as it does on one."""
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        # Then no store listens on MASTER_PORT until rank 0's init_process_group: waiting would hang.
        sys.exit(
            "error: with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun starts no store before the process "
            "group, so the ranks cannot agree on a run directory; pass hydra.run.dir=<a directory every "
            "node sees>"
        )
    key = f"distlib/run_dir/{os.environ['TORCHELASTIC_RUN_ID']}"
    return _agent_store(60).compare_set(key, "", proposed).decode()


def worker_argv(argv: list[str]) -> list[str]:
    """A torchrun worker's command line for Hydra: the start agreed with the other ranks
    (``join_job_start``), the run directory shared with them (unless given), ``dist.world_size``
    from torchrun (unless given), and Hydra's files and job log left to rank 0."""
    if any(arg in ("-m", "--multirun") for arg in argv[1:]):
        sys.exit(
            "error: a Hydra sweep (-m) starts its own workers; run it with plain `python train.py -m ...`"
        )
    try:
        join_job_start()  # one key prefix and start number on every node (torchrun counts per node)
    except StartError as exc:
        rank_error(str(exc))
        sys.exit(1)
    argv = list(argv)
    if not any(arg.startswith("hydra.run.dir=") for arg in argv[1:]):
        stamp = datetime.datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")
        argv.append(f"hydra.run.dir={shared_run_dir(stamp)}")
    if not any(arg.startswith("dist.world_size=") for arg in argv[1:]):
        argv.append(f"dist.world_size={os.environ['WORLD_SIZE']}")  # torchrun decides
    if os.environ.get("RANK", "0") != "0":
        argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    return argv
