"""The commands, and the output shown for them, in README.md and docs/*.md, as the tests read them
(tests/test_readme_commands.py, tests/test_doc_commands.py).

What a document may hold:

- A fenced block labelled ``bash``, ``sh`` or ``shell`` is commands: one per line, a line ending in
  ``\\`` continued on the next, a here-document (``<<'EOF'`` ... ``EOF``) part of its command, ``#``
  comments dropped. A ``console`` block is ``$ command`` lines, each followed by its output.
- An unlabelled block is text (a diagram, a shown output), unless its first line looks like a
  command: that is a mistake to fix (label it ``bash``). A ``python`` block is one too: write it as a
  ``.venv/bin/python - <<'EOF'`` command, which runs as written.
- Markers are HTML comments (not shown on the rendered page) on the lines right before a block:

  ``<!-- not run by the suite: REASON -->``: no command of the block runs in the suite;
  ``<!-- not run by the suite: REASON: PREFIX, PREFIX -->``: the block's commands starting with a
  PREFIX do not; REASON is one of ``REASONS``;
  ``<!-- output of: COMMAND -->``: the block is what COMMAND (a command of the same document)
  prints; the test that runs it checks it (``output_mismatches``);
  ``<!-- stopped by the suite once it prints "TEXT": PREFIX -->``: the block's commands starting
  with PREFIX serve until stopped; the suite stops them once their output holds TEXT;
  ``<!-- losses of: RUN_DIR -->`` before a Markdown table whose first column is ``step``: its loss
  columns are what RUN_DIR/metrics.jsonl records (``table_mismatches``);
  ``<!-- recorded on: KEY -->`` with an ``output of`` block or a ``losses of`` table: what it shows
  is one machine kind's (KEY as the golden files name it, ``golden_runs.machine_key()``), as a long
  run's figures and generated text are; it is compared only on that kind, except that
  ``<!-- elsewhere within: TOLERANCE -->`` has a table's losses compared everywhere else within
  TOLERANCE.

- The programs that live in ``.venv`` (python, torchrun, pip, ...) are called by their
  ``.venv/bin/`` path, in blocks and in inline code alike; docs/gpu.md, whose commands run on a GPU
  machine's own torch, says so instead.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Why a command may stay out of the suite; nothing else is a reason.
REASONS = ("GPU", "SLURM cluster", "several hosts", "minutes of work", "needs root")
COMMAND_LABELS = ("bash", "sh", "shell")
# Called by their .venv/bin/ path (the system Python has no torch).
VENV_TOOLS = ("python", "python3", "torchrun", "pip", "pip3", "pytest", "ruff", "tensorboard")
# Documents whose commands run outside .venv, and the words by which they say so.
OWN_PYTHON = {"docs/gpu.md": "the machine's own"}
# Generated documents: their text comes from code (`make config-doc`), so their inline code is that
# code's to fix; their code blocks are checked like any other.
GENERATED: tuple[str, ...] = ()

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
_LOOKS_LIKE_COMMAND = re.compile(
    r"^(\$ |\.venv/bin/|scripts/\S|(python3?|torchrun|make|bash|sudo|pip3?|pytest|git)\s|[A-Z_]+=\S+ \S)"
)
_INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])")
_ELLIPSIS = re.compile(r"\.\.\.|…")
_TABLE_MARKERS = ("losses of:", "recorded on:", "elsewhere within:")
_MACHINE_KEY = re.compile(r"^[A-Z][A-Z0-9]*(-amx)?$")  # as golden_runs.machine_key() writes one


@dataclass
class Shown:
    """An output a document shows for a command."""

    line: int  # its first line in the document (1-based)
    lines: list[str]
    recorded_on: str | None = None  # a machine key: compared only on that kind of machine


@dataclass
class Table:
    """A Markdown table of losses by step that a document shows for a run."""

    line: int  # its marker's line (1-based)
    run_dir: str
    rows: list[list[str]]
    recorded_on: str | None = None  # a machine key: compared as shown only on that kind
    elsewhere_within: float | None = None  # on another kind, each loss within this; None: not compared


@dataclass
class Command:
    doc: str  # the document, relative to the repository root
    line: int  # its first line there (1-based)
    text: str  # as written: what bash runs
    key: str  # its first line(s), comments dropped, blanks collapsed: how markers and other blocks name it
    skip: str | None = None  # the marker's reason, when it does not run in the suite
    until: str | None = None  # a server: the text after which the suite stops it
    outputs: list[Shown] = field(default_factory=list)  # what the document shows it printing

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def same(self) -> str:
        """Equal for two commands that do the same (a here-document's text included)."""
        return " ".join(_strip_comment(line) for line in self.text.splitlines()).strip()


@dataclass
class Doc:
    path: str
    commands: list[Command] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # every rule broken, "path:line: what"
    tables: list[Table] = field(default_factory=list)  # losses-of tables
    text: str = ""


def _strip_comment(line: str) -> str:
    """A shell line without its trailing ``# comment`` (a ``#`` after a blank, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _key(lines: list[str]) -> str:
    """The command as one line: continuations joined, comments dropped, blanks collapsed; of a
    here-document, the line that starts it."""
    head = lines
    for i, line in enumerate(lines):
        if _HEREDOC.search(_strip_comment(line)):
            head = lines[: i + 1]
            break
    return " ".join(" ".join(_strip_comment(line).rstrip("\\") for line in head).split())


def _split_commands(body: list[str], first: int) -> list[tuple[int, list[str]]]:
    """(line, lines) of every command of a bash block whose first line is document line ``first``."""
    out, i = [], 0
    while i < len(body):
        line = body[i]
        if not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        start, lines = i, [line]
        while _strip_comment(lines[-1]).endswith("\\") and i + 1 < len(body):
            i += 1
            lines.append(body[i])
        heredoc = _HEREDOC.search(_strip_comment(lines[-1]))
        if heredoc:
            while i + 1 < len(body):
                i += 1
                lines.append(body[i])
                if body[i].strip() == heredoc.group(2):
                    break
        out.append((first + start, lines))
        i += 1
    return out


def _program(key: str) -> str:
    """The program a command line starts (after ``VAR=value`` assignments and ``sudo``)."""
    words = key.split()
    while words and (re.match(r"^[A-Za-z_]\w*=", words[0]) or words[0] == "sudo"):
        words = words[1:]
    return words[0] if words else ""


def _bare_tool(program: str) -> bool:
    return program in VENV_TOOLS


def _apply_markers(doc: Doc, line: int, markers: list[str], commands: list[Command]) -> list[str]:
    """Apply a block's skip/until markers to its commands; returns its 'output of' targets."""
    output_of = []
    for marker in markers:
        if marker.startswith("not run by the suite:"):
            rest = marker.split(":", 1)[1].strip()
            reason, _, prefixes = rest.partition(":")
            reason = reason.strip()
            if reason not in REASONS:
                doc.problems.append(
                    f"{doc.path}:{line}: '{reason}' is no reason to leave a command out (one of {REASONS})"
                )
                continue
            chosen = [p.strip() for p in prefixes.split(",") if p.strip()] if prefixes else None
            for prefix in chosen or []:
                if not any(c.key.startswith(prefix) for c in commands):
                    doc.problems.append(f"{doc.path}:{line}: no command of the block starts with '{prefix}'")
            for c in commands:
                if chosen is None or any(c.key.startswith(p) for p in chosen):
                    c.skip = reason
        elif marker.startswith("stopped by the suite once it prints"):
            found = re.match(r'stopped by the suite once it prints "(.+?)":\s*(.+)$', marker)
            if not found:
                doc.problems.append(f"{doc.path}:{line}: unreadable marker: {marker}")
                continue
            matched = [c for c in commands if c.key.startswith(found.group(2).strip())]
            if not matched:
                doc.problems.append(
                    f"{doc.path}:{line}: no command of the block starts with '{found.group(2)}'"
                )
            for c in matched:
                c.until = found.group(1)
        elif marker.startswith("output of:"):
            output_of.append(" ".join(marker.split(":", 1)[1].split()))
        elif marker.startswith("losses of:"):
            doc.problems.append(
                f"{doc.path}:{line}: 'losses of' goes before a Markdown table, not a code block"
            )
    return output_of


def parse(path: str) -> Doc:
    """Every command of the document ``path`` (relative to the repository root), what it shows
    them printing, and every rule the document breaks."""
    doc = Doc(path)
    doc.text = (ROOT / path).read_text(encoding="utf-8")
    lines = doc.text.splitlines()
    pending: list[tuple[int, str]] = []  # markers above the current line, not yet attached
    wanted_outputs: list[tuple[int, str, list[str]]] = []
    in_block_lines: set[int] = set()
    i = 0
    while i < len(lines):
        marker = _MARKER.match(lines[i])
        if marker:
            pending.append((i + 1, marker.group(1)))
            i += 1
            continue
        fence = _FENCE.match(lines[i])
        if not fence:
            if lines[i].strip():
                _table_or_stray(doc, lines, i, pending)
                pending = []
            i += 1
            continue
        indent, ticks, label = fence.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(ticks):
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]
        ]
        in_block_lines.update(range(i, end + 1))
        markers = [m for _, m in pending]
        pending = []
        first = i + 2  # the document line of body[0]
        commands: list[Command] = []
        if label in COMMAND_LABELS:
            commands = [Command(path, n, "\n".join(ls), _key(ls)) for n, ls in _split_commands(body, first)]
        elif label == "console":
            for n, line in enumerate(body):
                if line.startswith("$ "):
                    commands.append(Command(path, first + n, line[2:], _key([line[2:]])))
                    commands[-1].outputs.append(Shown(first + n + 1, []))
                elif commands and line.strip():
                    commands[-1].outputs[-1].lines.append(line)
        elif label == "python":
            doc.problems.append(
                f"{doc.path}:{i + 1}: a python block: write it as a `.venv/bin/python - <<'EOF'` command "
                "(bash), which the suite runs as written"
            )
        elif label in ("", "text") and body and _LOOKS_LIKE_COMMAND.match(body[0]):
            doc.problems.append(f"{doc.path}:{i + 1}: an unlabelled block of commands: label it bash")
        output_of = _apply_markers(doc, i + 1, markers, commands)
        recorded_on, within = _machine_markers(doc, i + 1, markers)
        if within is not None:
            doc.problems.append(
                f"{path}:{i + 1}: 'elsewhere within' is for a losses table; a block is compared only "
                "on the kind it was recorded on"
            )
        if recorded_on and not output_of:
            doc.problems.append(f"{path}:{i + 1}: 'recorded on' goes with an 'output of' block")
        for target in output_of:
            shown = Shown(first, [line for line in body if line.strip()], recorded_on)
            wanted_outputs.append((i + 1, target, shown))
        if path not in OWN_PYTHON:
            for c in commands:
                if _bare_tool(_program(c.key)):
                    doc.problems.append(
                        f"{c.id}: `{_program(c.key)}` without `.venv/bin/` (the system Python has no torch)"
                    )
        doc.commands.extend(commands)
        i = end + 1
    for line, target, shown in wanted_outputs:
        found = [c for c in doc.commands if c.key == target]
        if len({c.same for c in found}) > 1:
            doc.problems.append(f"{path}:{line}: 'output of' names more than one command: {target}")
        if not found:
            doc.problems.append(f"{path}:{line}: 'output of' names no command of this document: {target}")
        else:
            found[0].outputs.append(shown)
            if found[0].skip:
                doc.problems.append(
                    f"{path}:{line}: output of a command the suite does not run: nothing checks it"
                )
    prose = "\n".join("" if n in in_block_lines else line for n, line in enumerate(lines))
    for n, line in enumerate(lines):
        if n not in in_block_lines and n and not lines[n - 1].strip() and line.startswith("    "):
            if _LOOKS_LIKE_COMMAND.match(line.strip()):
                doc.problems.append(f"{path}:{n + 1}: an indented command: fence it as a bash block")
    if path not in OWN_PYTHON and path not in GENERATED:
        start = 0
        for paragraph in re.split(r"(\n\s*\n)", prose):  # a code span stays within its paragraph
            for m in _INLINE.finditer(paragraph):
                span = " ".join(m.group(2).split())
                if _bare_tool(_program(span)) and " " in span:
                    where = prose.count("\n", 0, start + m.start()) + 1
                    doc.problems.append(f"{path}:{where}: `{span}`: write `.venv/bin/{span}`")
            start += len(paragraph)
    if path in OWN_PYTHON and OWN_PYTHON[path] not in doc.text:
        doc.problems.append(f"{path}: does not say that its commands use {OWN_PYTHON[path]} python")
    return doc


def _machine_markers(doc: Doc, line: int, markers: list[str]) -> tuple[str | None, float | None]:
    """A block's or table's 'recorded on' machine key and 'elsewhere within' tolerance, if marked."""
    recorded_on = within = None
    for marker in markers:
        name, _, value = marker.partition(":")
        if name == "recorded on":
            recorded_on = value.strip()
            if not _MACHINE_KEY.match(recorded_on):
                doc.problems.append(
                    f"{doc.path}:{line}: '{recorded_on}' is no machine key (AVX2, AVX512-amx, ...)"
                )
        elif name == "elsewhere within":
            try:
                within = float(value)
            except ValueError:
                doc.problems.append(f"{doc.path}:{line}: 'elsewhere within' needs a number: {value.strip()}")
                within = math.inf
    if within is not None and recorded_on is None:
        doc.problems.append(f"{doc.path}:{line}: 'elsewhere within' without 'recorded on'")
    return recorded_on, within


def _table_or_stray(doc: Doc, lines: list[str], i: int, pending: list[tuple[int, str]]) -> None:
    """Markers before a line of text: a 'losses of' table, or markers attached to nothing."""
    of = [(line, m) for line, m in pending if m.startswith("losses of:")]
    table = bool(of) and lines[i].lstrip().startswith("|")
    if table:
        rows = []
        for row in lines[i:]:
            if not row.lstrip().startswith("|"):
                break
            rows.append([cell.strip() for cell in row.strip().strip("|").split("|")])
        recorded_on, within = _machine_markers(doc, of[0][0], [m for _, m in pending])
        doc.tables.append(Table(of[0][0], of[0][1].split(":", 1)[1].strip(), rows, recorded_on, within))
    for line, marker in pending:
        if table and marker.startswith(_TABLE_MARKERS):
            continue
        if marker.startswith(_TABLE_MARKERS + ("not run by the suite", "output of", "stopped by the suite")):
            doc.problems.append(
                f"{doc.path}:{line}: a marker that is not right before a code block: {marker}"
            )


def documents() -> list[str]:
    """docs/*.md, relative to the repository root, in name order."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))


# --- shown output against real output -------------------------------------------------------------


def _literal(text: str) -> str:
    return r"\s+".join(re.escape(word) for word in re.split(r"\s+", text))


def _pattern(shown: str) -> tuple[re.Pattern, list[str]]:
    """A shown line as a regex over a printed line: ``...`` stands for anything, blanks for any
    blanks, and each number is a group (compared by ``_same_number``); and the shown numbers."""
    parts, numbers = [], []
    for k, piece in enumerate(_ELLIPSIS.split(shown.strip())):
        if k:
            parts.append(".*?")
        pos = 0
        for m in _NUMBER.finditer(piece):
            parts.append(_literal(piece[pos : m.start()]))
            parts.append(r"([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)")
            numbers.append(m.group())
            pos = m.end()
        parts.append(_literal(piece[pos:]))
    return re.compile("".join(parts)), numbers


def _same_number(shown: str, printed: str) -> bool:
    """A shown figure against the printed one: an integer exactly; a decimal within one unit of
    its last digit (another CPU kind may round the last digit the other way); a figure in
    e-notation (rounding noise, such as a loss difference of 1e-7) to within a factor of 10, zero
    exactly."""
    a, b = float(shown), float(printed)
    if "e" in shown.lower():
        return a == b == 0 or (a != 0 and b != 0 and (a > 0) == (b > 0) and abs(math.log10(a / b)) <= 1)
    if "." in shown:
        unit = 10.0 ** -len(shown.split(".")[1])
        return abs(a - b) <= unit * 1.0001
    return shown.lstrip("+") == printed.lstrip("+")


def output_mismatches(shown: list[str], printed: str) -> list[str]:
    """The shown lines (in order) that the printed output does not hold, each on a line of its own
    and in the same order; a line that is only ``...`` (with a note after it) elides lines."""
    printed_lines = [line.strip() for line in printed.splitlines()]
    missing, pos = [], 0
    for line in shown:
        if not line.strip() or _ELLIPSIS.match(line.strip()):
            continue
        pattern, numbers = _pattern(line)
        for k in range(pos, len(printed_lines)):
            m = pattern.fullmatch(printed_lines[k])
            if m and all(_same_number(s, p) for s, p in zip(numbers, m.groups())):
                pos = k + 1
                break
        else:
            missing.append(line)
    return missing


def table_mismatches(rows: list[list[str]], records: list[dict], within: float | None = None) -> list[str]:
    """A Markdown table of losses by step (header ``step``, then columns named ``loss``, ``train
    loss`` or ``val loss``) against the run's metrics.jsonl records (the last record of a step is
    its final one), each figure within one unit of its last digit, or within ``within``."""
    steps = {r["step"]: r for r in records if r.get("type") == "step"}
    fields = {"loss": "loss", "train loss": "loss", "val loss": "val_loss"}
    header, problems = [h.lower() for h in rows[0]], []
    if header[0] != "step" or not all(h in fields for h in header[1:]):
        return [f"a losses table has columns step, then {sorted(fields)}: {rows[0]}"]
    for row in rows[2:]:
        step = int(row[0])
        for name, cell in zip(header[1:], row[1:]):
            value = steps.get(step, {}).get(fields[name])
            digits = len(cell.split(".")[1]) if "." in cell else 0
            if within is not None:
                same = value is not None and abs(float(cell) - value) <= within
            else:
                same = value is not None and _same_number(cell, f"{value:.{digits}f}")
            if not same:
                problems.append(f"step {step} {name}: the document says {cell}, the run {value}")
    return problems
