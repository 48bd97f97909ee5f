"""The RNG states of this process, as a checkpoint shard holds them (no pickle: tensors and JSON).

torch's and numpy's generator states are tensors in the shard; python's state and numpy's position
go into its JSON ``rank_state``. On a CUDA device its generator is saved too, as ``rng.cuda``.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng(device: torch.device | str = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, json) holding the torch, numpy and python global RNG states, and on a CUDA
    ``device`` that device's generator as ``rng.cuda`` (absent on the CPU: CPU checkpoints are
    byte-identical to those written before GPUs were supported)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    tensors = {
        "rng.torch": torch.get_rng_state(),
        "rng.numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
    }
    if torch.device(device).type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    meta = {
        "numpy": [np_kind, int(np_pos), int(np_has_gauss), float(np_gauss)],
        "python": [py_version, list(py_state), py_gauss],
    }
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    kind, pos, has_gauss, gauss = meta["numpy"]
    np.random.set_state((kind, tensors["rng.numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, state, py_gauss = meta["python"]
    random.setstate((version, tuple(state), py_gauss))


def restore_device_rng(tensors: dict[str, torch.Tensor], device: torch.device | str) -> None:
    """The saved CUDA generator into a CUDA ``device``. A checkpoint saved on the CPU has none
    (the device's generator keeps its seeding); on the CPU a saved one is not needed."""
    if torch.device(device).type == "cuda" and "rng.cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.cuda"], device)
