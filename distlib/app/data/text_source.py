"""A text source for the BPE path: one UTF-8 file, or a directory of ``*.txt`` files.

A directory means every regular ``*.txt`` file under it (recursively; symlinked directories are
not followed), sorted by relative POSIX path (code-point order, which for UTF-8 names is also
``LC_ALL=C sort`` order). Any path component starting with "." is hidden and skipped, so
``.git/`` or an editor's ``.notes.txt`` never leaks into the corpus. The files' texts are joined
with ``SEPARATOR`` ("\\n\\n", none after the last), so no document runs into the next one's first
word.

The source's identity (``TextSource.sha256``, recorded in checkpoints for resume):

- a single file: the sha256 of its bytes, the same value the byte-level path records;
- a directory: the sha256 of ``sha256sum``-style lines ``"<content sha256>  <relative path>\\n"``
  in the sorted order above, so renaming, adding or editing any file changes it.

The train / held-out split is a byte offset into the joined text (``split_byte``): the last
``int(bytes * val_fraction)`` bytes, moved back to the start of a UTF-8 character.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from distlib.app.data.tokens import DataError, hash_utf8_file

SEPARATOR = "\n\n"


@dataclass(frozen=True)
class TextSource:
    root: Path
    files: tuple[tuple[str, Path, str, int], ...]  # (relative path, path, content sha256, bytes)
    sha256: str
    is_dir: bool

    @property
    def nbytes(self) -> int:
        """Bytes of the joined text, separators included."""
        return sum(f[3] for f in self.files) + len(SEPARATOR.encode()) * (len(self.files) - 1)


def record(source: TextSource) -> list:
    """``source`` as plain values (JSON, a collective's payload): ``from_record`` reads it back."""
    return [
        str(source.root),
        [[rel, str(path), sha, size] for rel, path, sha, size in source.files],
        source.sha256,
    ]


def from_record(listed: list) -> TextSource:
    root, files, sha = listed
    return TextSource(
        Path(root), tuple((rel, Path(p), h, size) for rel, p, h, size in files), sha, Path(root).is_dir()
    )


def _text_files(root: Path, suffixes: tuple[str, ...]) -> list[tuple[str, Path]]:
    found = []
    for directory, subdirs, names in os.walk(root):  # followlinks=False: no cycles through symlinks
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        for name in names:
            path = Path(directory) / name
            if name.startswith(".") or not name.endswith(suffixes) or not path.is_file():
                continue
            found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def list_files(
    path: str | Path, suffixes: tuple[str, ...] = (".txt",)
) -> tuple[Path, list[tuple[str, Path]]]:
    """(root, [(relative path, path)]) of the source (a directory: its files ending with one of
    ``suffixes``), without reading the files; DataError if it does not exist or a directory holds
    no such file. Cheap: train.py runs it before launching."""
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(
            f"data.path {root} does not exist (relative paths start at the launch directory {Path.cwd()})"
        )
    if root.is_file():
        return root, [(root.name, root)]
    if not root.is_dir():
        raise DataError(f"data.path {root} is neither a regular file nor a directory")
    listed = _text_files(root, suffixes)
    if not listed:
        kinds = " or ".join(f"*{s}" for s in suffixes)
        raise DataError(
            f"data.path {root} is a directory without any {kinds} file (hidden files and "
            f"directories are ignored): there is nothing to train on"
        )
    return root, listed


def _hash(path: Path) -> tuple[str, int]:
    """(sha256, bytes) of a source file: a text checked as UTF-8, a parquet file as it is."""
    if path.name.endswith(".parquet"):
        raw = path.read_bytes()
        return hashlib.sha256(raw).hexdigest(), len(raw)
    return hash_utf8_file(path)


def scan(path: str | Path, suffixes: tuple[str, ...] = (".txt",)) -> TextSource:
    """Hash (and check as UTF-8) every file of the source. DataError naming the file otherwise."""
    root, listed = list_files(path, suffixes)
    files = tuple((rel, p, *_hash(p)) for rel, p in listed)
    if sum(f[3] for f in files) == 0:
        raise DataError(f"data.path {root} is empty: there is nothing to train on")
    if root.is_dir():
        lines = "".join(f"{sha}  {rel}\n" for rel, _, sha, _ in files)
        sha = hashlib.sha256(lines.encode("utf-8")).hexdigest()
    else:
        sha = files[0][2]
    return TextSource(root, files, sha, root.is_dir())


def read_bytes(path: Path, sha256: str) -> bytes:
    """A source file's bytes. DataError if it changed since ``scan`` hashed it."""
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != sha256:
        raise DataError(f"data.path {path} changed while it was being tokenized; run again")
    return raw


def read_file(path: Path, sha256: str) -> str:
    """A source file's text (``read_bytes``, as UTF-8)."""
    return read_bytes(path, sha256).decode("utf-8")


def read_text(source: TextSource) -> str:
    """The joined text. DataError if a file changed since ``scan`` hashed it."""
    return SEPARATOR.join(read_file(path, sha) for _, path, sha, _ in source.files)


def _byte_at(source: TextSource, offset: int) -> int:
    """Byte ``offset`` of the joined text, read from its file (a separator byte is ASCII)."""
    sep = len(SEPARATOR.encode())
    for _, path, _, size in source.files:
        if offset < size:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(1)[0]
        offset -= size
        if offset < sep:
            return SEPARATOR.encode()[offset]
        offset -= sep
    raise IndexError(offset)


def split_byte(source: TextSource, val_fraction: float) -> int:
    """Where the held-out text starts: the byte-level path's cut (``data.split_heldout``), moved
    back over UTF-8 continuation bytes (0b10xxxxxx, at most 3) to the start of a character."""
    total = source.nbytes
    cut = total - int(total * val_fraction)
    while 0 < cut < total and _byte_at(source, cut) & 0xC0 == 0x80:
        cut -= 1
    return cut


def split_text(text: str, cut: int) -> tuple[str, str]:
    """(train text, held-out text) of ``text`` cut at byte ``cut`` (a character boundary)."""
    raw = text.encode("utf-8")
    return raw[:cut].decode("utf-8"), raw[cut:].decode("utf-8")
