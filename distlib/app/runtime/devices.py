"""Which device a rank computes on (``train.device``), decided without touching the CUDA driver.

auto: "cuda:<LOCAL_RANK % GPUs>" under dist.backend=nccl, else "cpu"; cuda: the same GPU choice
with any backend (gloo then stages the CUDA tensors through host memory, so several ranks can
share one GPU); cpu: the CPU.
"""

from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda")


def cuda_devices() -> int:
    """GPUs this process can use. Not torch.cuda.is_available(): that initialises the CUDA driver,
    and `python train.py` validates the config before it forks its workers, whose CUDA would then
    be unusable; device_count asks NVML and leaves the driver alone."""
    return torch.cuda.device_count()


def no_cuda_reason() -> str:
    cuda = torch.version.cuda or "not built in"
    return f"this machine has no usable CUDA GPU (torch {torch.__version__}, CUDA {cuda})"


def on_gpu(train_device: str, backend: str) -> bool:
    """Whether the ranks compute on GPUs (see the module doc)."""
    return not (train_device == "cpu" or (train_device == "auto" and backend != "nccl"))


def rank_device(train_device: str, backend: str, local_rank: int) -> str:
    """ "cpu" or "cuda:<k>" for the rank with this ``local_rank`` (see the module doc)."""
    if not on_gpu(train_device, backend):
        return "cpu"
    return f"cuda:{local_rank % cuda_devices()}"
