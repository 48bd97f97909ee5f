"""What the generators a checkpoint saved draw, against what the process's draw: the RNG half of
``Checkpointer.verify_resume``."""

from __future__ import annotations

import random

import numpy as np
import torch

_DRAWS = 4  # numbers drawn from each generator by the resume check


def seed_process_rngs(seed: int, rank: int) -> None:
    """Seed the global torch / numpy / python RNGs (dropout and anything else that draws from
    them), differently per rank, so that two runs of the same config are byte-identical."""
    torch.manual_seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    random.seed(seed + rank)


def saved_rng_draws(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, list[float]]:
    """What torch, numpy and python generators in the states ``rng_state.capture_rng`` saved draw
    first (private generators: the process's own are not touched)."""
    torch_gen = torch.Generator()
    torch_gen.set_state(tensors["rng.torch"])
    kind, pos, has_gauss, gauss = meta["numpy"]
    numpy_gen = np.random.RandomState()
    numpy_gen.set_state((kind, tensors["rng.numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, state, py_gauss = meta["python"]
    python_gen = random.Random()
    python_gen.setstate((version, tuple(state), py_gauss))
    return {
        "torch": torch.rand(_DRAWS, generator=torch_gen, dtype=torch.float64, device="cpu").tolist(),
        "numpy": numpy_gen.random_sample(_DRAWS).tolist(),
        "python": [python_gen.random() for _ in range(_DRAWS)],
    }


def process_rng_draws() -> dict[str, list[float]]:
    """What the process's global generators draw next (dropout draws from these); their states are
    put back afterwards."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        drawn = {
            "torch": torch.rand(_DRAWS, dtype=torch.float64, device="cpu").tolist(),
            "numpy": np.random.random_sample(_DRAWS).tolist(),
            "python": [random.random() for _ in range(_DRAWS)],
        }
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    return drawn
