"""The layered layout stays true: every import of every distlib module obeys its package's rule,
there is no import circle, and no module or class grows past its size limit.

  comm  <-  parallel  <-  checkpoint  <-  app  <-  launch  <-  train.py

Each package's rule is the paragraph in its ``__init__.py``; RULES below is that paragraph as
data. A failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "distlib"
MAX_MODULE_LINES = 350
MAX_CLASS_LINES = 250

LIBRARY = ("distlib.comm", "distlib.parallel", "distlib.checkpoint")

# package -> distlib modules it may import (prefixes); third-party names it must not import.
RULES = {
    "distlib.comm": (("distlib.comm",), ()),
    "distlib.parallel": (("distlib.comm", "distlib.parallel"), ()),
    "distlib.checkpoint": (
        (
            "distlib.comm",
            "distlib.checkpoint",
            "distlib.parallel.flat_layout",
            "distlib.parallel.tensor_parallel",
            "distlib.parallel.adamw",
        ),
        (),
    ),
    # the application's sub-packages (the most specific package of a module is the one whose rule applies)
    "distlib.app.config": (
        LIBRARY + ("distlib.app.config", "distlib.app.runtime.devices", "distlib.app.runtime.faults"),
        (),
    ),
    "distlib.app.runtime": (LIBRARY + ("distlib.app.config", "distlib.app.runtime"), ()),
    "distlib.app.model": (
        LIBRARY + ("distlib.app.config", "distlib.app.model", "distlib.app.observe.activations"),
        (),
    ),
    "distlib.app.data": (LIBRARY + ("distlib.app.config", "distlib.app.data"), ()),
    "distlib.app.observe": (
        # a run's result carries the resume check's outcome (checkpointing never imports observe)
        LIBRARY + ("distlib.app.config", "distlib.app.observe", "distlib.app.checkpointing.resume_check"),
        (),
    ),
    "distlib.app.unattended": (
        LIBRARY + ("distlib.app.config", "distlib.app.observe", "distlib.app.unattended"),
        (),
    ),
    "distlib.app.checkpointing": (
        LIBRARY
        + (
            "distlib.app.config",
            "distlib.app.model",
            "distlib.app.data",
            # the rollback's API (RollbackSource, which the Checkpointer implements) and the
            # save/stop decision; unattended never imports checkpointing, so there is no cycle
            "distlib.app.unattended.rollback",
            "distlib.app.unattended.stopping",
            "distlib.app.runtime.hooks",
            "distlib.app.runtime.launcher_env",
            "distlib.app.checkpointing",
        ),
        (),
    ),
    "distlib.app": (LIBRARY + ("distlib.app",), ()),
    "distlib.launch": (("distlib",), ()),
}
NO_THIRD_PARTY = {  # the library and the application take plain arguments, never Hydra's tree
    "distlib.comm": ("hydra", "omegaconf"),
    "distlib.parallel": ("hydra", "omegaconf"),
    "distlib.checkpoint": ("hydra", "omegaconf"),
    "distlib.app": ("hydra", "omegaconf"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # "from distlib.pkg import mod" imports the module distlib.pkg.mod (and of the package only
            # its __init__, which holds no code); any other name is the package's own
            modules = [base + "." + a.name for a in node.names if _is_module(base + "." + a.name)]
            if len(modules) < len(node.names):
                out.append((node.lineno, base))
            out += [(node.lineno, m) for m in modules]
    return out


def package_of(module: str) -> str | None:
    """The most specific package of RULES that holds ``module``."""
    found = [p for p in RULES if module == p or module.startswith(p + ".")]
    return max(found, key=len) if found else None


def all_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def violations() -> list[str]:
    found = []
    for path in all_modules():
        me = module_name(path)
        pkg = package_of(me)
        if pkg is None:
            if me != "distlib":
                found.append(f"{path.relative_to(ROOT)}: module outside every package of the layout")
            continue
        allowed, _ = RULES[pkg]
        for line, target in imports(path):
            where = f"{path.relative_to(ROOT)}:{line}: {me} imports {target}"
            top = target.split(".")[0]
            if top in NO_THIRD_PARTY.get(pkg, ()):
                found.append(f"{where} ({pkg} never imports {top})")
            if (
                top == "distlib"
                and target != "distlib"
                and not any(target == a or target.startswith(a + ".") for a in allowed)
            ):
                found.append(f"{where} (rule of {pkg}: only {', '.join(allowed)})")
    return found


def circles() -> list[str]:
    """Import cycles between distlib modules (module-level and function-level imports alike)."""
    graph = {module_name(p): {t for _, t in imports(p) if t.startswith("distlib.")} for p in all_modules()}
    graph = {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items()}
    # a package's __init__ is imported by its modules implicitly; only explicit edges count
    seen, stack, out = set(), [], []

    def visit(m: str) -> None:
        if m in stack:
            cycle = stack[stack.index(m) :] + [m]
            out.append(" -> ".join(cycle))
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for t in sorted(graph[m]):
            visit(t)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    return out


def test_every_import_obeys_its_package_rule():
    assert violations() == [], "\n" + "\n".join(violations())


def test_no_import_circles():
    assert circles() == [], "\n" + "\n".join(circles())


def test_every_package_states_its_rule():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80 and "TODO" not in doc, f"{init.relative_to(ROOT)}: needs a one-paragraph rule"


def test_no_module_or_class_too_long():
    problems = []
    for path in all_modules():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            problems.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines > {MAX_MODULE_LINES}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                problems.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: class {node.name} is "
                    f"{node.end_lineno - node.lineno + 1} lines > {MAX_CLASS_LINES}"
                )
    assert problems == [], "\n" + "\n".join(problems)


def test_the_checker_catches_a_bad_import(tmp_path, monkeypatch):
    """The rules can fail: a library module importing the application is reported with its line."""
    bad = PACKAGE / "comm" / "_layering_probe.py"
    bad.write_text("import torch\nfrom distlib.app import config\n")
    try:
        found = violations()
    finally:
        bad.unlink()
    assert any("distlib/comm/_layering_probe.py:2" in v and "distlib.app" in v for v in found), found


# --------------------------------------------------------------------------- the one rank order

LAYOUT_OWNER = "distlib/comm/layout.py"
_SIZE = re.compile(r"^(\w+\.)*(old_)?(tp|dp|pp|cp|ep)(_size|\.size)?$|^per_stage$")
_WORLD = re.compile(r"world")
# file -> why its arithmetic on a size is not a rank (reviewed; a new entry needs a reason)
NOT_RANKS: dict[str, str] = {}


def _is_size(node: ast.AST) -> bool:
    """An expression naming a layout dimension's size: tp, old_dp, mesh.pp.size, cfg.dist.tp, ..."""
    return bool(_SIZE.match(ast.unparse(node)))


def _rank_arithmetic(tree: ast.AST) -> list[tuple[int, str]]:
    """Expressions computing a rank from sizes, ``a * tp + b``, or a dimension from the world,
    ``world // (tp * pp)``: the layout's business alone."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.BinOp):
            continue
        mult = node.left if isinstance(node.op, ast.Add) else None
        if (
            isinstance(mult, ast.BinOp)
            and isinstance(mult.op, ast.Mult)
            and any(_is_size(x) for x in (mult.left, mult.right))
        ):
            found.append((node.lineno, ast.unparse(node)))
        right = node.right
        sizes = isinstance(right, ast.BinOp) and isinstance(right.op, ast.Mult) and _is_size(right.left)
        if (
            isinstance(node.op, ast.FloorDiv)
            and _WORLD.search(ast.unparse(node.left))
            and (sizes or _is_size(right))
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def rank_arithmetic_outside_the_layout(files) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path in files
        if str(path.relative_to(ROOT)) not in (LAYOUT_OWNER, *NOT_RANKS)
        for line, text in _rank_arithmetic(ast.parse(path.read_text()))
    ]


def test_no_module_but_the_layout_computes_a_rank_from_the_sizes():
    assert rank_arithmetic_outside_the_layout(sorted(PACKAGE.rglob("*.py"))) == []


def test_the_rank_check_catches_the_arithmetic_the_layout_replaced(tmp_path):
    old = tmp_path / "old.py"
    old.write_text(
        "files = [(s * dp + d) * tp + t for d in range(dp)]\n"
        "own = (pp_rank * old_dp + rank) * tp + tp_rank\n"
        "dp = int(manifest['world_size']) // (tp * pp)\n"
        "shift = (mesh.pp.size - 1 - mesh.pp.rank) * (mesh.world.size // mesh.pp.size)\n"
    )
    found = {text for _, text in _rank_arithmetic(ast.parse(old.read_text()))}
    assert {
        "(s * dp + d) * tp + t",
        "(pp_rank * old_dp + rank) * tp + tp_rank",
        "int(manifest['world_size']) // (tp * pp)",
        "mesh.world.size // mesh.pp.size",
    } <= found, found
