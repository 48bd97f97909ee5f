"""Model FLOPs utilisation: the model's arithmetic per second against what this machine can do.

Per step the model needs about 6 x P x tokens floating-point operations (2 per parameter and token
forward, 4 backward; attention's score arithmetic is left out, as in the usual MFU), with P the
parameters a token meets (all tensor-parallel shards together; of a mixture of experts the routed
experts it is sent to, not all of them: ``active_param_count``). The peak
is measured once at start, on every rank at the same time (so ranks sharing cores see the share
they get; a lost rank's replacement measures its own alone, and the ranks that stayed keep theirs):
the best of a few 256x256 fp32 matrix multiplies (2 x 256^3 operations each), summed over ranks::

    mfu = 6 * P * tokens_per_step / step_time_s / sum over ranks of peak_flops

The probe takes a few milliseconds and touches no RNG (the inputs are constants). On a GPU such a
small product measures launch latency, not the tensor cores: there the peak is the data sheet's
dense figure for the run's dtype (``KNOWN_PEAKS``), or ``metrics.peak_flops`` when given. The run
prints which it used.
"""

from __future__ import annotations

import os
import time

import torch

from distlib.comm import agree
from distlib.comm.group import Comm

PROBE_N = 256
PROBE_REPEATS = 8


def probe_flops(device: torch.device, n: int = PROBE_N, repeats: int = PROBE_REPEATS) -> float:
    """Floating-point operations per second of this process on ``device``: the fastest of
    ``repeats`` n x n fp32 matrix multiplies (after one warm-up; a CUDA device is synchronised
    around each, so the time is the kernel's, not its launch's)."""
    a = torch.full((n, n), 0.5, device=device)
    b = torch.full((n, n), 0.25, device=device)

    def wait() -> None:
        if a.device.type == "cuda":
            torch.cuda.synchronize(a.device)

    torch.mm(a, b)
    wait()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        torch.mm(a, b)
        wait()
        best = min(best, time.perf_counter() - began)
    return 2 * n**3 / max(best, 1e-9)


# Dense (no sparsity) peak FLOP/s per GPU from NVIDIA's data sheets, bf16 and fp32 (fp32 without
# TF32, torch's default for matmuls); matched against torch.cuda.get_device_name(), first hit wins.
KNOWN_PEAKS = (
    ("H200", {"bf16": 989e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp32": 19.5e12}),
)


def known_peak(device: torch.device, dtype: str) -> tuple[float, str] | None:
    """This GPU's data-sheet peak for ``dtype`` (bf16 or fp32) and where it came from, if listed."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in KNOWN_PEAKS:
        if fragment in name:
            return peaks[dtype], f"{name}: data sheet, dense {dtype}"
    return None


def job_peak(comm: Comm, device: torch.device, dtype: str, per_rank: float | None) -> tuple[float, str]:
    """The job's peak FLOP/s for MFU and its source: ``per_rank`` (metrics.peak_flops) if given, else
    the device's data-sheet figure, else measured (``peak_flops``, collective). Every rank must take
    the same branch: the same config and the same kind of device."""
    if per_rank:
        return per_rank * comm.size, f"metrics.peak_flops={per_rank:g} per rank"
    known = known_peak(torch.device(device), dtype)
    if known is not None:
        return known[0] * comm.size, known[1]
    return peak_flops(comm, device), f"measured: the best of {PROBE_REPEATS} {PROBE_N}x{PROBE_N} fp32 matmuls"


# This process's probe per device: a rank that stays through a lost peer's replacement (the own
# agent's generations, distlib/launch/worker.py) keeps the figure it measured beside the others at
# the job's start instead of probing again, alone with the replacement, on the recovery's path
# (14 ms of a survivor's recovery in a py-spy trace of the capstone; benchmarks/chaos.py's median
# kill-to-next-step did not move beyond its run-to-run spread, 0.14-0.16 s). Keyed by process id
# too: a fork probes for itself.
_PROBED: dict[tuple[int, str], float] = {}


def probed(device: torch.device) -> float:
    """This process's probe of ``device``, measured on its first call in the process."""
    key = (os.getpid(), str(device))
    if key not in _PROBED:
        _PROBED[key] = probe_flops(device)
    return _PROBED[key]


def peak_flops(comm: Comm, device: torch.device) -> float:
    """Every rank's probe (once per process and device), summed: the job's peak. Collective (one
    gather)."""
    return sum(row[0] for row in agree.gather([probed(device)], comm))


def mfu(model_flops_per_step: float, seconds: float, peak: float) -> float | None:
    return model_flops_per_step / seconds / peak if seconds > 0 and peak > 0 else None
