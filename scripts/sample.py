"""Generate text from a trained model (any model.family), on one process, with no distributed setup.

    python scripts/sample.py outputs/.../checkpoints/step_00000300 --prompt "Rank zero" --tokens 200
    python scripts/sample.py model.safetensors --prompt "The ring" --temperature 0.8 --top-k 20 --seed 1

CHECKPOINT is a sharded checkpoint directory of any layout (verified against its
manifest, then reassembled) or a consolidated .safetensors file. A model trained with
data.tokenizer=bpe takes and prints text through the checkpoint's own copy of
its tokenizer (CHECKPOINT/tokenizer/, listed and hashed in the manifest; for a
.safetensors file, the tokenizer/ that `ckpt.py consolidate` wrote beside it);
a byte-level model (vocabulary 256, data=text) takes and prints text; any other
vocabulary (the synthetic corpus) takes and prints space-separated token ids.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from distlib.app.checkpointing.sampling import SampleError, generate, load_model
from distlib.app.data.bpe import tokenizer_for_checkpoint
from distlib.app.data.tokens import BYTE_VOCAB, ByteTokenizer, DataError
from distlib.checkpoint.sharded import CheckpointError, read_manifest


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="checkpoint directory (with manifest.json) or a .safetensors file")
    p.add_argument("--prompt", required=True, help="text to continue (token ids for a non-byte vocabulary)")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy; default 1.0")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument(
        "--n-heads",
        type=int,
        default=None,
        help="attention heads, only for a .safetensors file without model metadata",
    )
    args = p.parse_args(argv)
    if args.tokens < 0:
        p.error(f"--tokens must be >= 0, got {args.tokens}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    try:
        model = load_model(args.checkpoint, args.n_heads)  # a checkpoint directory: verified
        path = Path(args.checkpoint)
        text_tok = tokenizer_for_checkpoint(path, read_manifest(path) if path.is_dir() else None)
        if text_tok is None and model.cfg.vocab_size == BYTE_VOCAB:
            text_tok = ByteTokenizer
        elif text_tok is not None and text_tok.vocab_size > model.cfg.vocab_size:
            raise SampleError(
                f"{path}: its tokenizer has {text_tok.vocab_size} tokens, more than the model's "
                f"{model.cfg.vocab_size}"
            )
        if text_tok is not None:
            prompt = text_tok.encode(args.prompt)
        else:
            try:
                prompt = [int(t) for t in args.prompt.split()]
            except ValueError:
                raise SampleError(  # noqa: B904 - the ValueError is the prompt's, named in the message
                    f"this model's vocabulary has {model.cfg.vocab_size} tokens, not the "
                    f"{BYTE_VOCAB} bytes of text; give --prompt as space-separated token ids"
                )
        generator = torch.Generator().manual_seed(args.seed)
        tokens = generate(model, prompt, args.tokens, args.temperature, args.top_k, generator)
    except (SampleError, CheckpointError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if text_tok is not None:
        sys.stdout.write(text_tok.decode(tokens) + "\n")
    else:
        print(" ".join(map(str, tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
