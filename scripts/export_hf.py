"""Write a checkpoint as a Hugging Face model directory, with no distributed setup.

    python scripts/export_hf.py outputs/.../checkpoints/step_00000020 exported/
    # then, in Python: transformers.AutoModelForCausalLM.from_pretrained("exported")

CHECKPOINT is a sharded checkpoint directory of a model.family=gpt2, llama, qwen3 or mixtral run, of
any layout and world size (ZeRO stage, tensor and pipeline parallelism): it is verified, reassembled
and written as config.json, model.safetensors and generation_config.json, plus the run's tokenizer
files when it had a tokenizer (their sha256 checked against the manifest). OUT_DIR must not exist yet.
MiniGPT is refused: it has no exact Hugging Face equivalent. See docs/models.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this repo's distlib

import torch

from distlib.app.checkpointing.hf_export import export
from distlib.app.model.hf_config import HFError
from distlib.checkpoint.sharded import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="export_hf.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="checkpoint directory (with manifest.json)")
    parser.add_argument("out", help="the Hugging Face model directory to write (must not exist)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        done = export(args.checkpoint, args.out)
    except (CheckpointError, HFError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {done.out}: {done.family}, {done.params} parameters, step {done.step} of {args.checkpoint} "
        f"({', '.join(done.files)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
