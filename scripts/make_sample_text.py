"""Write data/sample.txt: the bundled training text for `data=text`, written for this project.

    python scripts/make_sample_text.py [OUTPUT]      # default: data/sample.txt
    python scripts/make_sample_text.py --jsonl OUTPUT   # the same text as jsonl documents


The text is hand-written prose about the project followed by generated
paragraphs from a small grammar (deterministic: a fixed seed, no third-party
text, nothing downloaded). It is English with a narrow vocabulary and a lot of
repeated structure, so a byte-level MiniGPT learns visible words within a few
hundred steps. tests/test_text_data.py checks the committed file is exactly
what this script writes.

With --jsonl the text is written as documents, one JSON object a line (``{"text": ...}``, the
form ``data.path=*.jsonl`` reads): the introduction, then each numbered chapter; joined they are
the text again. A run with an existing tokenizer packs them (``data.document_mask``, docs/models.md).
"""

from __future__ import annotations

import argparse
import json
import random
import textwrap
from pathlib import Path

SEED = 20240607
TARGET_BYTES = 120_000

INTRODUCTION = """\
Notes on a small distributed trainer

This file was written for the project so that the trainer has some real text to read. It is
not literature. It talks about the thing that reads it: a small language model trained by
four processes that share the work and agree, after every step, on exactly the same numbers.

Each process is called a rank. Rank zero is the first of them and the only one that writes
the shared files: the metrics, the logs and the manifest of each checkpoint. The other ranks
do the same arithmetic on different data and send their results around a ring. When the
ring has gone all the way round, every rank holds the same sum, and from the same sum they
all take the same step.

The model is tiny. It has two blocks of attention and a small feed-forward layer in each.
It reads a window of text one byte at a time and guesses the next byte. At first it guesses
badly, about as well as picking a byte at random. After a few hundred steps it knows that a
space often follows a word, that a full stop is followed by a space and a capital letter,
and that the word rank is often followed by the word zero. Bytes are not characters: the
word “naïve” takes twelve bytes with its curly quotes, and the arrow → takes three.

A checkpoint is a folder. Every rank writes its own shard of the optimizer state into it,
and rank zero writes the manifest last. The manifest lists every file with its size and its
hash. A checkpoint without a manifest was never finished and is never loaded. When a run
starts again from a checkpoint, it checks every hash first, then puts every byte back where
it was: the weights, the moments of the optimizer, the random number generators and the
position in the data. The run that resumes and the run that never stopped then print the
same losses, bit for bit.

The data are read in windows. A window is a short run of bytes from the text, and a step
uses a fixed number of windows for all ranks together. Which windows a step uses depends
only on the seed and the step number, not on how many ranks there are, so four ranks and
two ranks see the same batch, split in different ways. The last part of the text is held
back. The model never trains on it; every so often the ranks score it together, and the
validation loss tells us whether the model learned the text or only memorised its windows.

"""

SUBJECTS = [
    "rank zero",
    "every rank",
    "the optimizer",
    "the manifest",
    "the checkpoint",
    "the model",
    "the ring",
    "the launcher",
    "the first node",
    "the second node",
    "the store",
    "each shard",
    "the gradient",
    "the loss",
    "the data loader",
    "the trainer",
    "a worker",
    "the scheduler",
]
VERBS = [
    "writes",
    "reads",
    "checks",
    "sends",
    "receives",
    "waits for",
    "agrees on",
    "keeps",
    "restores",
    "saves",
    "splits",
    "gathers",
    "averages",
    "counts",
    "records",
    "verifies",
]
OBJECTS = [
    "the manifest",
    "its shard",
    "the gradients",
    "the step number",
    "the random state",
    "the next window",
    "the learning rate",
    "a hash of every file",
    "the same sum",
    "the parameters",
    "the held out text",
    "the loss of the step",
    "the position in the data",
    "the moments of the optimizer",
    "a message from the ring",
    "the run directory",
]
ENDINGS = [
    "before the next step",
    "after every step",
    "once at the start",
    "at the end of the run",
    "when the clock says so",
    "when the loss jumps",
    "in the same order on every rank",
    "without waiting for anyone",
    "and then waits",
    "so that nothing is lost",
    "so that the ranks agree",
    "and tells rank zero",
    "one byte at a time",
    "in a single message",
]
OPENERS = [
    "Then",
    "After that",
    "Meanwhile",
    "At the same time",
    "Only then",
    "First",
    "Later",
    "In the end",
    "Every time",
    "As a rule",
    "Usually",
    "Sometimes",
]
TOPICS = [
    ("On checkpoints", ["the checkpoint", "the manifest", "each shard", "rank zero"]),
    ("On the ring", ["the ring", "every rank", "a worker", "the gradient"]),
    ("On resuming", ["the trainer", "the checkpoint", "the data loader", "the optimizer"]),
    ("On two machines", ["the first node", "the second node", "the launcher", "the store"]),
    ("On the data", ["the data loader", "the model", "the loss", "every rank"]),
]
QUESTIONS = [
    ("Who writes the manifest?", "Rank zero writes it, after every shard has been written and hashed."),
    (
        "What happens if a shard is damaged?",
        "Its hash no longer matches the manifest, and the checkpoint is refused.",
    ),
    (
        "Why do the ranks agree?",
        "Because they add the same numbers in the same order and take the same step.",
    ),
    ("What does the held out text measure?", "How well the model predicts text it has never trained on."),
    ("How many ranks are there?", "Four on one machine, or two on each of two machines."),
    ("What is a window?", "A short run of bytes from the text, one more than the model reads."),
    ("What does the loss measure?", "How surprised the model is by the next byte."),
    ("When is a checkpoint saved?", "Every ten steps, or when the clock says enough time has passed."),
]


def sentence(rng: random.Random, subjects: list[str]) -> str:
    subject = rng.choice(subjects)
    text = f"{subject} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}."
    if rng.random() < 0.35:
        text = f"{rng.choice(OPENERS)} {text}"
    return text[0].upper() + text[1:]


def paragraph(rng: random.Random, subjects: list[str]) -> str:
    body = " ".join(sentence(rng, subjects) for _ in range(rng.randint(3, 6)))
    return textwrap.fill(body, width=92)


def log_block(rng: random.Random, start: int) -> str:
    loss = 5.55 - 0.2 * rng.random()
    lines = []
    for step in range(start, start + rng.randint(3, 5)):
        loss *= 1 - 0.02 * rng.random()
        lines.append(f"step {step}: loss {loss:.3f}, every rank agrees.")
    return "\n".join(lines)


def generate(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> str:
    return "".join(documents(seed, target_bytes))


def documents(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> list[str]:
    """The text's documents: the introduction, then each chapter."""
    rng = random.Random(seed)
    parts, size, chapter, step = [INTRODUCTION], len(INTRODUCTION), 1, 1
    while size < target_bytes:
        title, subjects = rng.choice(TOPICS)
        block = [f"{chapter}. {title}", ""]
        for _ in range(rng.randint(2, 4)):
            block += [paragraph(rng, subjects), ""]
        if rng.random() < 0.5:
            question, answer = rng.choice(QUESTIONS)
            block += [f"Question: {question}", f"Answer: {answer}", ""]
        if rng.random() < 0.4:
            block += [log_block(rng, step), ""]
            step += 5
        text = "\n".join(block) + "\n"
        parts.append(text)
        size += len(text.encode("utf-8"))
        chapter += 1
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", default=None, help="default: data/sample.txt")
    parser.add_argument("--jsonl", action="store_true", help="write the documents as jsonl")
    args = parser.parse_args()
    if args.jsonl and args.output is None:
        parser.error("--jsonl needs OUTPUT (data/sample.txt stays the text)")
    out = Path(args.output) if args.output else Path(__file__).resolve().parent.parent / "data" / "sample.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = documents()
    if args.jsonl:
        text = "".join(json.dumps({"text": part}) + "\n" for part in parts)
    else:
        text = "".join(parts)
    out.write_text(text, encoding="utf-8")
    print(
        f"wrote {out}: {len(text.encode('utf-8'))} bytes"
        + (f", {len(parts)} documents" if args.jsonl else "")
    )


if __name__ == "__main__":
    main()
