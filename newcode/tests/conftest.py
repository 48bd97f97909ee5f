"""Make the repo root (distlib) and newcode/ (families, hf, ...) importable; keep transformers offline."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
NEWCODE = os.path.dirname(HERE)
ROOT = os.path.dirname(NEWCODE)
# The package `distlib` shadows PyPI's `distlib` (a virtualenv dependency): ours must come first.
for path in (NEWCODE, ROOT):
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)

# Set before transformers is imported anywhere (huggingface_hub reads it at import time).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)
