"""The GPU kinds the planner prices a step for without one (``scripts/plan.py plan.device=h100``,
and ``dist.layout=auto`` on a GPU run): NVIDIA's data-sheet figures as a ``timing.Machine``.

Per kind (SXM parts): the dense matmul peak in the run's dtype (fp32 without TF32, torch's default
for matmuls; the same figures as ``observe.throughput.KNOWN_PEAKS``), the HBM bandwidth, NVLink's
bandwidth per GPU and direction, the memory. What the planner assumes beside them (not measured:
no GPU was lent when this was written; docs/parallelism.md says so):

- an operator costs ``OP_S`` beyond its arithmetic (eager PyTorch's dispatch and kernel launch,
  which bounds small kernels), a written byte ``ELEMENTWISE`` bytes of HBM traffic (an
  elementwise kernel reads two inputs for each output), an AdamW element ``ADAMW_BYTES``;
- one GPU per rank (nothing is shared); a collective costs ``LATENCY_S`` plus the bytes a ring
  moves per GPU (an all-reduce 2 (N-1)/N B, a reduce-scatter, all-gather or all-to-all
  (N-1)/N B, a send B) over NVLink within ``NODE`` GPUs, over the network (``NETWORK``, one
  400 Gb/s NDR port per GPU) for a larger group; nothing overlaps.

So a predicted GPU step is a data-sheet bound: real steps are slower, by how much each layout's
kernels fall short of the peaks.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from distlib.app.plan.timing import Machine

OP_S = 10e-6
ELEMENTWISE = 3
ADAMW_BYTES = 72  # fp32 master, two moments and the gradient, read and written over 7 kernels
LATENCY_S = 10e-6
NODE = 8
NETWORK = 50e9


@dataclass(frozen=True)
class Kind:
    name: str
    flops: dict  # dense FLOP/s by train.dtype
    hbm: float  # bytes/s
    nvlink: float  # bytes/s per GPU, one direction
    memory_gb: float  # decimal GB (what plan.budget_gb defaults to)


KINDS = {
    "a100": Kind("A100 SXM 80GB", {"bf16": 312e12, "fp32": 19.5e12}, 2.039e12, 300e9, 80.0),
    "h100": Kind("H100 SXM 80GB", {"bf16": 989e12, "fp32": 67e12}, 3.35e12, 450e9, 80.0),
    "h200": Kind("H200 SXM 141GB", {"bf16": 989e12, "fp32": 67e12}, 4.8e12, 450e9, 141.0),
}
DEVICES = ("cpu", *KINDS)  # plan.device's values


@dataclass(frozen=True)
class Link:
    """NVLink within a node, the network across nodes (the module's assumptions)."""

    nvlink: float

    def collective_s(self, kind: str, nbytes: int, size: int) -> float:
        if kind == "handoff":  # overlap queues on a stream: no thread to wake
            return 0.0
        bandwidth = self.nvlink if size <= NODE else NETWORK
        share = 1.0 if kind == "send" else (size - 1) / size * (2 if kind == "all_reduce" else 1)
        return LATENCY_S + share * nbytes / bandwidth


def machine(kind: str, dtype: str, world_size: int) -> Machine:
    """``kind``'s data-sheet figures for a run in ``dtype`` of ``world_size`` ranks, one GPU each."""
    k = KINDS[kind]
    return Machine(
        flops=k.flops[dtype],
        op_s=OP_S,
        byte_s=ELEMENTWISE / k.hbm,
        update_s=ADAMW_BYTES / k.hbm,
        cores=world_size,
        name=k.name,
        link=Link(k.nvlink),
    )


def kind_named(gpu: str) -> str | None:
    """The kind of a GPU by its name (``nvidia-smi``'s, or torch's), None when not listed."""
    for kind in sorted(KINDS, key=len, reverse=True):
        if kind.upper() in gpu.upper():
            return kind
    return None


def local_kind() -> str | None:
    """This host's GPU kind from ``nvidia-smi`` (which does not start CUDA in this process: the
    launcher forks its workers after asking), None without one or when not listed."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return kind_named(names[0]) if names else None
