"""The golden runs: per-step losses (float hex) of every existing layout, a contract.

``tests/golden/losses-<capability>.json`` were written by this module and are committed, one per
CPU instruction set met (``torch.backends.cpu.get_cpu_capability()``: AVX2 and AVX-512 kernels
round differently); ``tests/test_golden.py`` reruns every layout and compares bitwise with the
file of the machine it runs on.
A refactor, a new device path or a new feature at its default must not change a single bit.
Record a new capability's file from a known-good commit (never from the change under test), and
regenerate only for a deliberate, documented change of arithmetic:

    .venv/bin/python tests/golden_runs.py --write     # this machine's capability
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

GOLDEN_DIR = Path(__file__).with_name("golden")


def golden_file(capability: str) -> Path:
    """Where the golden runs of a CPU capability (``torch.backends.cpu.get_cpu_capability()``) are."""
    return GOLDEN_DIR / f"losses-{capability}.json"


# name -> (world size, Hydra overrides). Every layout the project had when the file was written.
LAYOUTS = {
    "capstone_stage1_ws4": (4, []),
    "stage0_ws4": (4, ["zero=stage0"]),
    "stage2_ws4": (4, ["zero=stage2"]),
    "stage3_ws4": (4, ["zero=stage3"]),
    "tp2_dp2_stage1": (4, ["dist.tp=2"]),
    "tp2_dp2_stage3": (4, ["dist.tp=2", "zero=stage3"]),
    "ws2_grad_accum4": (2, ["train.grad_accum=4"]),
    "dropout0.1_ws4": (4, ["model.dropout=0.1"]),
    "bf16_stage2_ws4": (4, ["train.dtype=bf16", "zero=stage2"]),
    "ws1": (1, []),
    "lr_spike_rollback_ws4": (
        4,
        ["fault.lr_spike_step=12", "fault.lr_spike_factor=300", "checkpoint.every_steps=5"],
    ),
}


def _run_one(comm, tree: dict, run_dir: str) -> dict:
    import contextlib
    import os

    import torch

    from distlib.app.config.run import RunConfig
    from distlib.app.faults import step_hooks
    from distlib.app.trainer import Trainer
    from distlib.launch.torchrun import use_deterministic_kernels

    use_deterministic_kernels()  # the product's switch: the same ATen flag, without torch._inductor
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        cfg = RunConfig.from_dict(tree)
        trainer = Trainer(cfg, comm, Path(run_dir), hooks=step_hooks(cfg.fault, comm.rank))  # as train.py
        result = trainer.run()
        params = trainer.optimizer.full_params()[: trainer.optimizer.layout.numel]  # collective at stage 3
    return {
        "losses": [s.loss.hex() for s in result.steps],
        "params_sha256": hashlib.sha256(
            params.detach().contiguous().view(torch.uint8).numpy().tobytes()
        ).hexdigest(),
    }


def run_layout(name: str) -> dict:
    """Run one golden layout on forked gloo ranks; rank 0's losses and final parameter digest."""
    from multiproc import run_ranks
    from trainrun import compose_tree

    world, overrides = LAYOUTS[name]
    tree = compose_tree([f"dist.world_size={world}", *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_run_one, world, tree, tmp)
    return results[0]


def main(argv: list[str]) -> int:
    if argv != ["--write"]:
        print(__doc__)
        return 2
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    table = {"_cpu_capability": capability}
    table |= {
        name: {"world_size": LAYOUTS[name][0], "overrides": LAYOUTS[name][1], **run_layout(name)}
        for name in LAYOUTS
    }
    path = golden_file(capability)
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path} ({len(LAYOUTS)} layouts)")
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
    import torch

    torch.set_num_threads(1)
    sys.exit(main(sys.argv[1:]))
