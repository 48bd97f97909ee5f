"""Generate text with Hugging Face transformers from a model directory scripts/export_hf.py wrote.

    python scripts/generate_hf.py outputs/text-demo/hf --prompt "Rank zero" --tokens 60

Everything runs through transformers' own classes, offline (nothing is downloaded):
AutoTokenizer and AutoModelForCausalLM from the directory, then ``generate`` -- greedy by default,
sampled with ``--temperature`` > 0 (and ``--top-k``). Needs the optional `hf` extra.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="generate_hf.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="a Hugging Face model directory with its tokenizer files")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--tokens", type=int, default=60, help="new tokens to generate (default 60)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch
        import transformers
    except ImportError:
        print(
            "error: generate_hf.py needs the optional `hf` extra: pip install transformers tokenizers",
            file=sys.stderr,
        )
        return 2
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        print(
            f"error: {args.model_dir} is not a Hugging Face model directory (no config.json)", file=sys.stderr
        )
        return 2
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    transformers.utils.logging.disable_progress_bar()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    inputs = tokenizer(args.prompt, return_tensors="pt")
    sampled = args.temperature > 0
    options = {"temperature": args.temperature, "top_k": args.top_k} if sampled else {}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.tokens, do_sample=sampled, **options)
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
