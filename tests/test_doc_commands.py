"""Every command in docs/*.md runs as written and prints what the document shows (issue 31).

tests/doc_commands.py says how a document's commands, its markers and the output it shows are read.
Here:

- ``test_documents_follow_the_rules``: every marker names one of the allowed reasons, every block of
  commands is labelled, the programs of .venv are called by their ``.venv/bin/`` path, every shown
  output belongs to a command the suite runs (no process starts).
- The commands that run do so as written, in document order, one after another in a fresh copy
  of the repository per group of documents (``GROUPS``): the files git tracks or would track, as
  in this working tree, with .venv linked in. What one command writes (``outputs/text-demo``,
  ``runs/job1``) is there for the next of its group, as on a fresh clone, and nothing is written
  into the repository. Each group is a test class, so pytest-xdist (``--dist loadscope``) gives
  the groups to different workers: the documents' commands no longer hold one worker for five
  minutes while the other runs out of work. A command that is ``.venv/bin/python SCRIPT.py ARGS``
  and nothing else (``_script_argv``: 32 of the 40) runs in a fork of the test process, which has
  imported torch: the same script, words (as bash reads them), directory and environment, without a
  fresh interpreter's start (measured on this file alone, 2 cores: 438 -> 302 CPU-s, 312 -> 210 s);
  every other command runs in bash, and the README's commands keep starting interpreters. ``$HOME`` is
  a temporary directory holding the files the documents call the reader's own (``notes.txt`` and
  ``corpus/``: data/sample.txt's text). torchrun gets a free port through ``PET_MASTER_PORT``, its
  own environment default for ``--master-port``, so the command stays as written. A command that
  the documents repeat word for word runs once.
- ``test_doc_command``, one per command that runs: exit status 0, and every output the document
  shows for it (a ``console`` block, or a block marked ``output of``) is in what it printed.
- ``test_recorded_output``: an output marked ``recorded on KEY`` (one machine kind's), on a
  machine of that kind; on another it is skipped, saying why.
- ``test_losses_tables``: each table marked ``losses of RUN_DIR`` against that run's metrics.jsonl
  (one marked ``recorded on KEY``: on another kind within its ``elsewhere within``, or skipped).
- ``test_overrides_tables``: each row of a table with an ``overrides`` column composes and passes
  the configuration check (``RunConfig.from_dict``), as train.py would before starting workers.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import doc_commands
import pytest
import text_demo_checks
from e2e import ROOT, free_port
from forkrun import run_script
from golden_runs import machine_key

DOCS = {path: doc_commands.parse(path) for path in doc_commands.documents()}
COMMANDS = [c for doc in DOCS.values() for c in doc.commands]
RUNNABLE = [c for c in COMMANDS if c.skip is None]
RECORDED = [(c, s) for c in RUNNABLE for s in c.outputs if s.recorded_on is not None]
TABLES = [(path, t) for path, doc in DOCS.items() for t in doc.tables]
# The documents whose commands run together, each group in its own copy, in this order. A group
# keeps the documents that read what another writes (docs/beyond.md and docs/models.md both use
# `make text-demo`'s outputs/text-demo, made once); the groups weigh about the same (measured alone
# on 2 cores: beyond + models 97 s, parallelism + checkpoints + unattended 92 s). A document with
# commands that no group names fails test_every_document_is_in_one_group.
GROUPS = {
    "Text": ("docs/beyond.md", "docs/models.md"),
    "Runs": ("docs/checkpoints.md", "docs/parallelism.md", "docs/unattended.md"),
}
TIMEOUT = 600  # seconds for one command (the longest, the sweep and the text demo, take ~30 s alone)


@dataclass
class Ran:
    returncode: int
    output: str  # stdout and stderr, as a terminal would show them
    seconds: float


def _copy_tree(dest: Path) -> None:
    """The files git tracks or would track, as they are in this working tree (mtimes kept, so make
    finds .venv's stamp as new as here), and .venv linked in."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name, follow_symlinks=False)
    (dest / ".venv").symlink_to(ROOT / ".venv")


def _home(home: Path) -> None:
    """The reader's own files the documents name: a text file and a directory of text files."""
    text = (ROOT / "data" / "sample.txt").read_text(encoding="utf-8")
    cut = text.index("\n", len(text) // 2) + 1
    (home / "corpus" / "more").mkdir(parents=True)
    (home / "notes.txt").write_text(text, encoding="utf-8")
    (home / "corpus" / "part1.txt").write_text(text[:cut], encoding="utf-8")
    (home / "corpus" / "more" / "part2.txt").write_text(text[cut:], encoding="utf-8")


# Shell syntax: a command with any of these in a word (its comment left out) runs in bash.
_SHELL = re.compile(r"[|&;<>()$`*?~\\\n]")


def _script_argv(cmd: doc_commands.Command, home: Path) -> list[str] | None:
    """[script, args...] of a command that is ``.venv/bin/python SCRIPT.py ARGS`` and nothing else
    (no shell syntax but bash's line continuations and ``$HOME`` outside single quotes, which are
    read as bash reads them; not a server the suite stops): such a command runs as written in a fork
    of this process, which has imported torch already (tests/forkrun.py); any other runs in bash."""
    if cmd.until is not None:
        return None
    text = cmd.text.replace("\\\n", "")  # a backslash-newline is no character to bash
    if "'" not in text:
        text = text.replace("${HOME}", str(home)).replace("$HOME", str(home))
    try:
        argv = shlex.split(text, comments=True)
    except ValueError:  # a quote shlex cannot close: bash's to read
        return None
    if any(_SHELL.search(word) for word in argv):
        return None
    if len(argv) < 2 or argv[0] != ".venv/bin/python" or not argv[1].endswith(".py"):
        return None
    return argv[1:]


def _run(cmd: doc_commands.Command, cwd: Path, home: Path) -> Ran:
    env = {"HOME": str(home), "PYTHONUNBUFFERED": "1", "PET_MASTER_PORT": str(free_port())}
    argv = _script_argv(cmd, home)
    if argv is not None:
        return _run_forked(argv, cwd, env)
    return _run_shell(cmd, cwd, {**os.environ, **env})


def _run_forked(argv: list[str], cwd: Path, env: dict) -> Ran:
    """The script's ``__main__`` with these arguments, from ``cwd``, in a fork: a fresh interpreter's
    start (about 2.5 CPU-s each, 20 of them here) is all that differs, and the start-up itself is
    tests/test_startup.py's and the README commands' (which keep launching interpreters)."""
    start = time.monotonic()
    try:
        proc = run_script(cwd / argv[0], *argv[1:], env=env, cwd=cwd, timeout=TIMEOUT, merged=True)
    except subprocess.TimeoutExpired:
        return Ran(124, f"[timed out after {TIMEOUT} s]", TIMEOUT)
    return Ran(proc.returncode, proc.stdout, time.monotonic() - start)


def _run_shell(cmd: doc_commands.Command, cwd: Path, env: dict) -> Ran:
    start = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-c", cmd.text],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: a timeout or a stop ends all it started
    )
    try:
        if cmd.until is None:
            output = proc.communicate(timeout=TIMEOUT)[0]
            return Ran(proc.returncode, output.decode(errors="replace"), time.monotonic() - start)
        # a server: read until it prints the text, then stop it (it has run as written)
        output, deadline = b"", start + TIMEOUT
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while cmd.until.encode() not in output and time.monotonic() < deadline:
                if sel.select(timeout=1):
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    if not chunk:
                        break
                    output += chunk
        served = cmd.until.encode() in output
        _signal_group(proc, signal.SIGTERM)
        proc.wait(timeout=30)
        code = 0 if served else (proc.returncode or 1)
        return Ran(code, output.decode(errors="replace"), time.monotonic() - start)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        output = proc.communicate()[0]
        return Ran(124, output.decode(errors="replace") + f"\n[timed out after {TIMEOUT} s]", TIMEOUT)
    finally:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to everything the command started (its process group), if any of it is left."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _workspace(base: Path) -> tuple[Path, Path]:
    (base / "repo").mkdir()
    (base / "home").mkdir()
    _copy_tree(base / "repo")
    _home(base / "home")
    return base / "repo", base / "home"


def _run_all(commands: list[doc_commands.Command], repo: Path, home: Path) -> dict[str, Ran]:
    """Every command given, in order, in the one copy: id -> what happened."""
    done: dict[str, Ran] = {}
    by_text: dict[str, Ran] = {}
    stale_venv = None
    for cmd in commands:
        if cmd.same in by_text:  # the same command again: the first run stands for it
            done[cmd.id] = by_text[cmd.same]
            continue
        if cmd.key.startswith("make ") and stale_venv is None:
            # make would reinstall a .venv older than the requirements (into the shared one): refuse
            q = subprocess.run(["make", "-q", ".venv/.installed"], cwd=repo, capture_output=True)
            stale_venv = q.returncode != 0
        if cmd.key.startswith("make ") and stale_venv:
            done[cmd.id] = Ran(1, ".venv is older than the requirements: run `make venv` first", 0.0)
            continue
        done[cmd.id] = by_text[cmd.same] = _run(cmd, repo, home)
    return done


def test_documents_follow_the_rules():
    problems = [p for doc in DOCS.values() for p in doc.problems]
    assert not problems, "\n".join(problems)
    assert RUNNABLE, "no command of docs/ runs in the suite"


def test_a_forked_command_reads_its_words_as_bash_does(tmp_path):
    """The commands that run in a fork (``_script_argv``) get the words bash would give them: each
    one's text with its program replaced by printf, run by bash with that HOME, prints the same."""
    forked = [(c, _script_argv(c, tmp_path)) for c in RUNNABLE]
    forked = [(c, argv) for c, argv in forked if argv is not None]
    assert len(forked) >= 20, "the fork path runs most of the documents' python commands"
    for cmd, argv in forked:
        shown = cmd.text.replace(".venv/bin/python", "printf '%s\\0'", 1)
        proc = subprocess.run(
            ["bash", "-c", shown], capture_output=True, env={**os.environ, "HOME": str(tmp_path)}, check=True
        )
        assert proc.stdout.decode().split("\0")[:-1] == argv, cmd.id


def test_every_document_is_in_one_group():
    grouped = [path for paths in GROUPS.values() for path in paths]
    assert len(grouped) == len(set(grouped)), f"a document in two groups: {grouped}"
    with_commands = sorted({c.doc for c in RUNNABLE})
    assert sorted(set(grouped) & set(DOCS)) == with_commands, (
        f"GROUPS must name each document whose commands run: {with_commands}, and no other"
    )


def _of(docs: tuple[str, ...], items: list, doc_of) -> list:
    return [item for item in items if doc_of(item) in docs]


@pytest.fixture(scope="class")
def workspace(tmp_path_factory) -> tuple[Path, Path]:
    """The copy of the repository (and the reader's home) one group's commands run in."""
    return _workspace(tmp_path_factory.mktemp("doc_commands"))


@pytest.fixture(scope="class")
def runs(request, workspace) -> dict[str, Ran]:
    """The group's commands (its class's DOCS), run once, in order: id -> what happened."""
    return _run_all(_of(request.cls.DOCS, RUNNABLE, lambda c: c.doc), *workspace)


class _Documents:
    """The tests of one group's documents (a subclass per group sets DOCS); the group's commands
    run once, in its own copy, when its first test needs them."""

    DOCS: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        """A group with no recorded output or no losses table has no such test (not an empty one)."""
        super().__init_subclass__(**kwargs)
        if not _of(cls.DOCS, RECORDED, lambda pair: pair[0].doc):
            cls.test_recorded_output = None
        if not _of(cls.DOCS, TABLES, lambda pair: pair[0]):
            cls.test_losses_tables = None

    @pytest.mark.slow
    def test_doc_command(self, cmd, runs):
        ran = runs[cmd.id]
        assert ran.returncode == 0, (
            f"{cmd.id}: exit status {ran.returncode} after {ran.seconds:.1f} s\n"
            f"$ {cmd.text}\n{ran.output[-4000:]}"
        )
        for shown in cmd.outputs:
            if shown.recorded_on is None:
                _check_shown(cmd, shown, ran)

    @pytest.mark.slow
    def test_recorded_output(self, cmd, shown, runs):
        _recorded_output(cmd, shown, runs)

    @pytest.mark.slow
    def test_losses_tables(self, path, table, runs, workspace):
        _losses_table(path, table, workspace[0])


class TestTextDocuments(_Documents):
    DOCS = GROUPS["Text"]

    @pytest.mark.slow
    def test_the_text_demo_learned_and_transformers_continues_it(self, runs, workspace):
        """docs/beyond.md's `make text-demo`, read once more (tests/text_demo_checks.py): the demo
        trains once per suite, here."""
        cmd = next(c for c in RUNNABLE if c.doc in self.DOCS and c.key == text_demo_checks.COMMAND)
        ran = runs[cmd.id]
        assert ran.returncode == 0, f"{cmd.id}: exit status {ran.returncode} (test_doc_command says more)"
        text_demo_checks.check(workspace[0], ran.output)


class TestRunDocuments(_Documents):
    DOCS = GROUPS["Runs"]


def pytest_generate_tests(metafunc):
    """Each group's tests over its own documents' commands, shown outputs and tables."""
    docs = getattr(metafunc.cls, "DOCS", None)
    if docs is None:
        return
    if metafunc.function.__name__ == "test_doc_command":
        cmds = _of(docs, RUNNABLE, lambda c: c.doc)
        metafunc.parametrize("cmd", cmds, ids=[c.id for c in cmds])
    elif metafunc.function.__name__ == "test_recorded_output":
        pairs = _of(docs, RECORDED, lambda pair: pair[0].doc)
        metafunc.parametrize("cmd,shown", pairs, ids=[f"{c.doc}:{s.line}" for c, s in pairs])
    elif metafunc.function.__name__ == "test_losses_tables":
        tables = _of(docs, TABLES, lambda pair: pair[0])
        metafunc.parametrize("path,table", tables, ids=[f"{p}:{t.line}" for p, t in tables])


def _check_shown(cmd: doc_commands.Command, shown: doc_commands.Shown, ran: Ran) -> None:
    missing = doc_commands.output_mismatches(shown.lines, ran.output)
    assert not missing, (
        f"{cmd.id}: the document shows lines (at line {shown.line}) this run did not print:\n"
        + "\n".join(missing)
        + f"\n--- what it printed (the end) ---\n{ran.output[-4000:]}"
    )


def _recorded_output(cmd: doc_commands.Command, shown: doc_commands.Shown, runs: dict[str, Ran]) -> None:
    """An output recorded on one machine kind: checked on that kind, skipped (saying why) elsewhere."""
    here = machine_key()
    if here != shown.recorded_on:
        pytest.skip(
            f"{cmd.doc}:{shown.line}: output recorded on {shown.recorded_on}; this machine is {here}, "
            "whose rounding takes a long run elsewhere"
        )
    ran = runs[cmd.id]
    assert ran.returncode == 0, f"{cmd.id}: exit status {ran.returncode} (test_doc_command says more)"
    _check_shown(cmd, shown, ran)


def _losses_table(path: str, table, repo: Path) -> None:
    """A ``losses of RUN_DIR`` table against the run's metrics.jsonl in the group's copy ``repo``."""
    within, here = None, machine_key()
    if table.recorded_on not in (None, here):
        if table.elsewhere_within is None:
            pytest.skip(
                f"{path}:{table.line}: losses recorded on {table.recorded_on}; this machine is {here}"
            )
        within = table.elsewhere_within
    metrics = repo / table.run_dir / "metrics.jsonl"
    assert metrics.is_file(), (
        f"{path}:{table.line}: no {table.run_dir}/metrics.jsonl: no command of the documents made it"
    )
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    problems = doc_commands.table_mismatches(table.rows, records, within)
    how = f" (recorded on {table.recorded_on}; here within {within})" if within is not None else ""
    assert not problems, f"{path}:{table.line}{how}: " + "\n".join(problems)


def _overrides_rows() -> list[tuple[str, int, list[str]]]:
    """(document, line, overrides) of every row of a Markdown table with an ``overrides`` column."""
    import re

    rows = []
    for path, doc in DOCS.items():
        column = None
        for n, line in enumerate(doc.text.splitlines(), 1):
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
            if cells is None:
                column = None
            elif column is None and "overrides" in cells:
                column = cells.index("overrides")
            elif column is not None and not set(line) <= set("|-: "):
                spans = re.findall(r"`([^`]+)`", cells[column])
                rows.append((path, n, [o for span in spans for o in span.split()]))
    return rows


@pytest.mark.parametrize(
    "path,line,overrides", _overrides_rows(), ids=[f"{p}:{n}" for p, n, _ in _overrides_rows()]
)
def test_overrides_tables(path, line, overrides):
    from distlib.app.config.run import ConfigError, RunConfig
    from distlib.launch.hydra_config import compose_tree

    try:
        RunConfig.from_dict(compose_tree(overrides))
    except ConfigError as exc:
        pytest.fail(f"{path}:{line}: {' '.join(overrides)}: config error: {exc}")
