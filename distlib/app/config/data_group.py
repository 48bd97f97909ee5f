"""The data group: which corpus a run reads and how its text becomes tokens.

``data.tokenizer`` is ``bytes`` (token i is byte i), ``bpe`` (one trained on the run's own text) or
the path of an existing tokenizer (a directory holding ``tokenizer.json``, as transformers saves
one, or the file): the ids a pretrained model was trained on. Of such a tokenizer the configuration
needs only how many ids it has, read here from its JSON (``id_range``); encoding with it is the
data package's (``distlib.app.data.pretrained``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from distlib.app.config.schema import ConfigError, Group, key, specs

BYTE_VOCAB = 256  # data.kind=text's byte-level tokenizer (distlib.app.data.tokens)
TOKENIZERS = ("bytes", "bpe")  # data.tokenizer's named choices; any other value is a tokenizer's path
BPE_MIN_VOCAB = BYTE_VOCAB + 1  # a BPE vocabulary holds the 256 byte tokens and <|endoftext|>
BPE_MAX_VOCAB = 1 << 32  # its token file stores ids as uint32
TOKENIZER_JSON = "tokenizer.json"
# Data keys that one corpus kind never reads: set with the other kind, they would change nothing.
DATA_NOT_USED_BY = {
    "synthetic": ("path", "cache_dir", "text_field", "mixture", "weights", "document_mask"),
    "text": ("seed", "total_tokens", "follow_prob"),
}


@dataclass(frozen=True)
class DataConfig(Group):
    """The corpus: synthetic, or a text as byte-level, BPE or an existing tokenizer's tokens, and its
    held-out share.

    kind: synthetic (make_corpus: a Markov chain with a favourite successor per token) or text (a UTF-8
        file, byte-level tokens; or documents, with data.tokenizer=bpe or a tokenizer's path)
    seed: synthetic: the corpus seed (the batch order uses the top-level seed)
    total_tokens: synthetic: corpus length in tokens
    follow_prob: synthetic: probability that a token is followed by its favourite successor
    path: text: the UTF-8 file (relative paths start at the launch directory); with data.tokenizer=bpe
        also a directory: its *.txt files, sorted by path; with a tokenizer's path also *.jsonl files (one
        document a line, its data.text_field), *.parquet files (one a row, the `parquet` extra) and
        directories of them
    cache_dir: text: directory for the token file (and bpe's cached tokenizer); null = next to the source
    val_fraction: held-out tail of the tokens for validation (train.eval_every), never trained on; 0 = none;
        with data.mixture each source's tail, and the validation windows shared out by data.weights
    tokenizer: text: bytes (token i is byte value i, 256 tokens), bpe (a byte-level BPE of data.vocab_size
        tokens trained on the training split with Hugging Face tokenizers, the optional `hf` extra; saved in
        <run dir>/tokenizer and in every checkpoint; docs/beyond.md) or the path of an existing tokenizer (a
        directory with tokenizer.json, or the file; the `hf` extra): its ids, each document ending with its
        end-of-text token; by default model.init_from's when that directory has one; docs/models.md
    vocab_size: bpe: the vocabulary to train (the model's follows it); null otherwise
    text_field: text with *.jsonl or *.parquet documents: the field (column) that holds each document's text
    mixture: text: several sources in place of data.path, each what data.path may be for data.tokenizer
        (bytes: a file; bpe: a file or directory of text, one tokenizer trained on all their training text;
        a tokenizer's path: documents too), each tokenized on its own; every global sample
        comes from one of them, drawn by data.weights from the seed and the sample's number alone, so every
        layout and a resume draw the same (docs/beyond.md); each step's record counts its samples per source
    weights: data.mixture's sampling weights, one per source, any positive numbers (their shares of the
        samples in expectation); null: equal
    document_mask: text with a tokenizer's path: each token attends only the tokens of its own document
        in the packed training sequences (block-diagonal causal; a document ends with the end-of-text
        token), and positions restart at 0 at each document, at every layout; false: one text
        (docs/models.md)
    """

    GROUP = "data"
    kind: str = key("synthetic", choices=("synthetic", "text"))
    seed: int = key(0, ge=0)
    total_tokens: int = key(65536, ge=2)
    follow_prob: float = key(0.9, ge=0, le=1)
    path: str | None = key(None)
    cache_dir: str | None = key(None)
    val_fraction: float = key(0.0, ge=0, lt=1)
    tokenizer: str = key("bytes")
    vocab_size: int | None = key(None, ge=BPE_MIN_VOCAB, le=BPE_MAX_VOCAB)
    text_field: str = key("text")
    mixture: tuple[str, ...] | None = key(None)
    weights: tuple[float, ...] | None = key(None, gt=0)
    document_mask: bool = key(False)

    @property
    def pretrained(self) -> bool:
        """Whether data.tokenizer names an existing tokenizer (a path) rather than bytes or bpe."""
        return self.tokenizer not in TOKENIZERS

    def check(self) -> None:
        if self.kind == "text" and not self.path and self.mixture is None:
            raise ConfigError("data.kind=text needs data.path: the UTF-8 text file to train on")
        defaults = {s.name: s.default for s in specs(type(self))}
        for name in DATA_NOT_USED_BY[self.kind]:
            if getattr(self, name) != defaults[name]:
                other = "data=text" if self.kind == "synthetic" else "the synthetic corpus (data=synthetic)"
                value = getattr(self, name)
                shown = str(value).lower() if isinstance(value, bool) else repr(value)  # as typed
                raise ConfigError(
                    f"data.{name}={shown} has no effect with data.kind={self.kind}: it is "
                    f"used by {other}; " + ("add data=text" if self.kind == "synthetic" else "leave it out")
                )
        if not self.tokenizer:
            raise ConfigError("data.tokenizer must be bytes, bpe or the path of a tokenizer, got ''")
        if self.tokenizer == "bpe" and self.kind != "text":
            raise ConfigError("data.tokenizer=bpe trains on a text: use it with data=text (data.kind=text)")
        if self.pretrained and self.kind != "text":
            raise ConfigError(
                f"data.tokenizer={self.tokenizer} encodes a text: use it with data=text (data.kind=text)"
            )
        if self.tokenizer == "bpe" and self.vocab_size is None:
            raise ConfigError(
                f"data.tokenizer=bpe needs data.vocab_size: the vocabulary to train (>= {BPE_MIN_VOCAB}: "
                f"{BYTE_VOCAB} byte tokens and <|endoftext|>)"
            )
        if self.tokenizer == "bytes" and self.vocab_size is not None:
            raise ConfigError(
                f"data.vocab_size={self.vocab_size} needs data.tokenizer=bpe; the byte tokenizer has "
                f"{BYTE_VOCAB} tokens (leave data.vocab_size null)"
            )
        self._check_mixture()
        if self.document_mask and not self.pretrained:
            raise ConfigError(
                f"data.document_mask=true needs documents that end with an end-of-text token: "
                f"data.tokenizer=PATH (an existing tokenizer); data.tokenizer={self.tokenizer} has none "
                f"(it joins documents with a blank line)"
            )
        if self.pretrained and self.vocab_size is not None:
            raise ConfigError(
                f"data.vocab_size={self.vocab_size} needs data.tokenizer=bpe; data.tokenizer="
                f"{self.tokenizer} has its own vocabulary (leave data.vocab_size null)"
            )

    def _check_mixture(self) -> None:
        if self.weights is not None and self.mixture is None:
            raise ConfigError("data.weights weighs the sources of data.mixture, which is not set")
        if self.mixture is None or self.kind != "text":
            return
        if self.path:
            raise ConfigError(
                f"data.mixture lists the sources in place of data.path={self.path}: set one of the two"
            )
        if not self.mixture or not all(self.mixture):
            raise ConfigError(
                f"data.mixture must list at least one source, each a path; got {list(self.mixture)}"
            )
        if self.weights is not None and len(self.weights) != len(self.mixture):
            raise ConfigError(
                f"data.weights has {len(self.weights)} weight(s) for the {len(self.mixture)} source(s) "
                f"of data.mixture: give one per source"
            )

    @property
    def sources(self) -> tuple[str, ...]:
        """The text sources a run reads: data.mixture's, or data.path alone."""
        return self.mixture if self.mixture is not None else (self.path,)

    @property
    def shares(self) -> tuple[float, ...]:
        """Each source's sampling weight, normalised to sum to 1."""
        weights = self.weights or (1.0,) * len(self.sources)
        return tuple(w / sum(weights) for w in weights)


def tokenizer_json(path: str | Path) -> Path:
    """The tokenizer.json a tokenizer path names (the directory's, or the file itself)."""
    path = Path(path).expanduser()
    return path / TOKENIZER_JSON if path.is_dir() else path


def id_range(path: str | Path) -> int:
    """One more than the largest token id of the tokenizer at ``path``: its vocabulary and its
    added tokens (a dict of token -> id, or Unigram's list of [token, score], id = place)."""
    file = tokenizer_json(path)
    if not Path(path).expanduser().exists():
        raise ConfigError(
            f"data.tokenizer must be bytes, bpe or the path of a tokenizer (a directory with "
            f"{TOKENIZER_JSON}, or the file); {path} does not exist"
        )
    try:
        tokenizer = json.loads(file.read_bytes())
    except OSError as exc:
        raise ConfigError(
            f"data.tokenizer names {file}, which cannot be read: {exc.strerror or exc}"
        ) from exc
    except ValueError as exc:
        raise ConfigError(
            f"data.tokenizer names {file}, which is not a tokenizer.json (not JSON: {exc})"
        ) from exc
    vocab = (tokenizer.get("model") or {}).get("vocab") if isinstance(tokenizer, dict) else None
    if not isinstance(vocab, (dict, list)) or not vocab:
        raise ConfigError(f"data.tokenizer names {file}, which is not a tokenizer.json (no model.vocab)")
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id", -1) for t in tokenizer.get("added_tokens") or [] if isinstance(t, dict)]
    return max(i for i in ids if isinstance(i, int)) + 1
