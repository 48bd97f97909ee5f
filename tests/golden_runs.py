"""The golden runs: per-step losses (float hex) of every existing layout, a contract.

``tests/golden/losses-<key>.json`` are committed, one per machine kind met. The key is what
decides how the kernels round: torch's CPU capability (``torch.backends.cpu.get_cpu_capability()``:
ATen's own AVX2 and AVX-512 kernels) plus ``-amx`` where the CPU has AMX tiles (oneDNN and MKL then
dispatch to other matmul kernels: on a Sapphire Rapids every layout differs from another AVX-512
machine's within two steps). The same rule keys the capstone's losses in the before-stop check
and the old-checkpoint fixture's resumed losses (tests/fixtures/*.expected.json).
A key cannot see everything (cache sizes, another vendor's AVX-512): where a machine has no file,
or its file's bits are not what the pinned known-good commit computes on it, tests/test_golden.py
compares with that commit run on the machine itself (tests/pinned_reference.py), never skips.

A refactor, a new device path or a new feature at its default must not change a single bit.
Record a new machine's file from the pinned commit (never from the change under test) and commit
it with the fixture's entry; the pinned run takes ~45 s:

    .venv/bin/python tests/golden_runs.py --record    # this machine's key, from the pinned commit

and rewrite the files only for a deliberate, documented change of arithmetic, from the working tree:

    .venv/bin/python tests/golden_runs.py --write     # this machine's key, from this tree's code

then pin the changed layouts to the commit that changes them (``pinned_reference.REPINNED``) and set
their entries in the files of machine kinds you cannot run to null (their next ``--record`` fills
them from that commit).

and to see where this machine's runs part from another kind's file (docs/bits.md):

    .venv/bin/python tests/golden_runs.py --compare tests/golden/losses-AVX2.json [LAYOUT ...]
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

GOLDEN_DIR = Path(__file__).with_name("golden")


def machine_key() -> str:
    """This machine's kind as the golden files are keyed (the module's docstring says why)."""
    import torch

    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n")[0].split()
    except (OSError, IndexError):
        flags = []
    capability = torch.backends.cpu.get_cpu_capability()
    return capability + ("-amx" if "amx_tile" in flags else "")


def golden_file(key: str) -> Path:
    """Where the golden runs of a machine key (``machine_key()``) are."""
    return GOLDEN_DIR / f"losses-{key}.json"


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
    from distlib.app.runtime.faults import step_hooks
    from distlib.app.trainer import Trainer
    from distlib.launch.torchrun import use_deterministic_kernels

    use_deterministic_kernels()  # the product's switch: the same ATen flag, without torch._inductor
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        cfg = RunConfig.from_dict(tree)
        trainer = Trainer(cfg, comm, Path(run_dir), hooks=step_hooks(cfg.fault, comm.rank))  # as train.py
        result = trainer.run()
        params = trainer.optimizer.full_params()  # collective at stage 3
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


def _write(key: str, layouts: dict, source: str) -> None:
    import torch

    table = {"_cpu_capability": torch.backends.cpu.get_cpu_capability(), "_source": source}
    table |= {
        name: {"world_size": LAYOUTS[name][0], "overrides": LAYOUTS[name][1], **layouts[name]}
        for name in LAYOUTS
    }
    golden_file(key).write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {golden_file(key)} ({len(LAYOUTS)} layouts)")


def _record(key: str) -> None:
    """The pinned commit run here: this key's golden file and the fixture's resumed losses."""
    from pinned_reference import FIXTURE, PINNED, REPINNED, build

    with tempfile.TemporaryDirectory() as tmp:
        ref = build(Path(tmp))
    repinned = "".join(f", {name} from {commit[:7]}" for name, commit in REPINNED.items())
    _write(key, ref["layouts"], f"pinned commit {PINNED[:7]}{repinned} on this machine kind")
    expected_path = FIXTURE.with_name(FIXTURE.name + ".expected.json")
    expected = json.loads(expected_path.read_text())
    expected["losses"][key] = ref["fixture"]
    expected_path.write_text(json.dumps(expected, indent=1) + "\n")
    print(f"added {key} to {expected_path}")


def _compare(path: str, names: list[str]) -> None:
    """Each layout run here against a golden file: the first step whose loss differs (docs/bits.md)."""
    table = json.loads(Path(path).read_text())
    for name in names or LAYOUTS:
        if table[name] is None:  # re-pinned and not yet recorded on that machine kind
            print(f"{name}: no entry in {path}", flush=True)
            continue
        got, want = run_layout(name)["losses"], table[name]["losses"]
        first = next((i + 1 for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        print(
            f"{name}: " + ("bitwise equal" if first is None else f"first differs at step {first}"), flush=True
        )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"] and len(argv) >= 2:
        _compare(argv[1], argv[2:])
        return 0
    if argv not in (["--write"], ["--record"]):
        print(__doc__)
        return 2
    key = machine_key()
    if argv == ["--record"]:
        _record(key)
    else:
        _write(key, {name: run_layout(name) for name in LAYOUTS}, "this tree's code")
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
    import torch

    torch.set_num_threads(1)
    sys.exit(main(sys.argv[1:]))
