"""Look at, check, consolidate and reshard sharded checkpoints, with no distributed setup.

    python scripts/ckpt.py inspect  CKPT                     # manifest, readably (no hashing)
    python scripts/ckpt.py verify   CKPT                     # sizes + sha256 of every file; exit 1 if damaged
    python scripts/ckpt.py consolidate CKPT OUT [--optimizer]   # OUT/model.safetensors (+ optimizer)
    python scripts/ckpt.py reshard  CKPT OUT --world-size M  # a new checkpoint for M ranks

CKPT is a checkpoint directory such as outputs/.../checkpoints/step_00000010. OUT must be a new
path outside every checkpoint directory: nothing is ever overwritten. consolidate and reshard
carry the checkpoint's extra files along (a BPE run's tokenizer/). See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this repo's distlib

from distlib.checkpoint import extra_files, offline, relayout
from distlib.checkpoint import sharded as checkpoint
from distlib.checkpoint.sharded import CheckpointError


def inspect(args: argparse.Namespace) -> None:
    from distlib.app.observe.summary import manifest_text

    manifest = checkpoint.read_manifest(args.path)
    numel, files = relayout.whole_layout(manifest).numel, manifest["files"]
    print(f"checkpoint {args.path} (not verified; run `verify` to check the hashes)")
    print(manifest_text(manifest))
    data = manifest.get("data")
    if data:
        print(
            f"  data position: next global sample {data['next_sample']}, "
            f"global batch {data['global_batch']}, "
            f"order seed {data['seed']}"
        )
    if "resharded_from" in manifest:
        source = manifest["resharded_from"]
        print(f"  resharded from {source['world_size']} rank(s): {source['path']}")
    files = files + extra_files.listed(manifest)
    on_disk = sum(f["bytes"] for f in files)
    print(
        f"  total: {numel} parameters, "
        f"{3 * 4 * numel} bytes of fp32 master + Adam state, "
        f"{on_disk} bytes in {len(files)} file(s)"
    )


def verify(args: argparse.Namespace) -> None:
    from distlib.app.checkpointing.manifest_config import manifest_config

    manifest = checkpoint.verify(args.path)
    manifest_config(manifest, args.path)  # its model and data config, checked like a run's
    files = manifest["files"] + extra_files.listed(manifest)
    total = sum(f["bytes"] for f in files)
    print(
        f"OK: {args.path}: step {manifest['step']}, {len(files)} file(s), {total} bytes, "
        f"every size and sha256 matches the manifest"
    )


def consolidate(args: argparse.Namespace) -> None:
    offline.check_new_output(args.out)
    for path in offline.consolidate(args.path, args.out, with_optimizer=args.optimizer):
        print(f"wrote {path}")


def reshard_cmd(args: argparse.Namespace) -> None:
    offline.check_new_output(args.out)
    out = offline.reshard_checkpoint(args.path, args.out, args.world_size)
    manifest = checkpoint.verify(out)
    print(f"wrote {out}: step {manifest['step']} for {manifest['world_size']} rank(s), verified")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ckpt.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("inspect", help="print the manifest: step, world size, stage, parameters, files")
    p.add_argument("path")
    p.set_defaults(run=inspect)
    p = commands.add_parser("verify", help="check size and sha256 of every file; exit status 1 if damaged")
    p.add_argument("path")
    p.set_defaults(run=verify)
    p = commands.add_parser("consolidate", help="write OUT/model.safetensors with full fp32 weights")
    p.add_argument("path")
    p.add_argument("out", help="output directory (must not exist, nor lie inside a checkpoint)")
    p.add_argument(
        "--optimizer",
        action="store_true",
        help="also write OUT/optimizer.safetensors (exp_avg.NAME, exp_avg_sq.NAME)",
    )
    p.set_defaults(run=consolidate)
    p = commands.add_parser("reshard", help="write a new checkpoint at OUT for --world-size ranks")
    p.add_argument("path")
    p.add_argument("out", help="new checkpoint directory (must not exist, nor lie inside a checkpoint)")
    p.add_argument("--world-size", type=int, required=True)
    p.set_defaults(run=reshard_cmd)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
