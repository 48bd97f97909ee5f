"""The pinned known-good commit's bits on this machine: the reference where no golden file fits.

Kernels round differently from one machine kind to another (tests/golden_runs.py says what the
golden files are keyed by), so a golden file holds one kind's bits. Anywhere else the bitwise
tests need bits computed here by code known to be good: PINNED, the commit the first golden files
were recorded from (before the layered-layout refactor). Its tree is taken with ``git archive``
(nothing is written into the repository or its .git), run by the current interpreter (the same
.venv, the same torch) in a subprocess whose ``sys.path`` holds that tree and not this one, and
the result is cached per (commit, torch, machine), so a machine pays for it once (~45 s here).

A layout whose arithmetic was changed on purpose is pinned to the commit that changed it instead
(REPINNED; the reason is in that commit's message): its reference is that commit's run here.

    .venv/bin/python tests/pinned_reference.py --tree DIR --commit SHA --layouts A,B --fixture CKPT --out FILE
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import warnings
from pathlib import Path

PINNED = "8ba1845a4d0da0459c6eeb576c8ec4dae081e195"
# layout -> the commit whose arithmetic it follows: dropout masks keyed by sample and site, so
# that they do not depend on the layout (issue 38)
REPINNED = {"dropout0.1_ws4": "41ad9dff24aa8583fb52abb1bfa3d5f0dbf9bffa"}
ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).with_name("fixtures") / "ckpt_v1_ws2_stage1_step10"


class Unavailable(Exception):
    """The pinned commit cannot be run here (no git, or no history holding it)."""


def commit_of(layout: str) -> str:
    """The commit whose bits are ``layout``'s reference."""
    return REPINNED.get(layout, PINNED)


def _machine_id(commit: str) -> str:
    """What the cache is kept for: the commit, torch, and the CPU as the kernels see it."""
    import torch

    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        import platform

        info = platform.processor() + platform.machine()
    lines = [x for x in info.splitlines() if x.split(":")[0].strip() in ("vendor_id", "model name", "flags")]
    text = "\n".join([commit, torch.__version__, torch.backends.cpu.get_cpu_capability(), *lines])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _pinned_tree(dest: Path, commit: str) -> Path:
    """``commit``'s files under ``dest`` (``git archive``: the repository is only read)."""
    try:
        proc = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True, timeout=120
        )
    except FileNotFoundError:
        raise Unavailable("git is not installed, so the pinned commit cannot be checked out") from None
    if proc.returncode != 0:
        raise Unavailable(
            f"this checkout has no history holding the pinned commit {commit[:7]} (a shallow clone or a "
            f"source archive; `git fetch --unshallow` brings it): {proc.stderr.decode().strip()[:200]}"
        )
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def build(cache_dir: Path) -> dict:
    """The golden layouts and the fixture resume by their pinned commits, run on this machine
    (cached per commit): PINNED's, with each re-pinned layout from its own commit."""
    from golden_runs import LAYOUTS

    ref = _run_commit(cache_dir, PINNED, [name for name in LAYOUTS if name not in REPINNED], fixture=True)
    for commit in sorted(set(REPINNED.values())):
        names = [name for name, c in REPINNED.items() if c == commit]
        ref["layouts"].update(_run_commit(cache_dir, commit, names, fixture=False)["layouts"])
    return ref


def _run_commit(cache_dir: Path, commit: str, layouts: list[str], fixture: bool) -> dict:
    """``commit``'s run of ``layouts`` (and of the fixture's resume) here, cached."""
    from filelock import FileLock

    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"pinned-{_machine_id(commit)}.json"
    with FileLock(str(path) + ".lock"):  # pytest-xdist workers: one builds, the others read
        if path.exists():
            return json.loads(path.read_text())
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            tree = _pinned_tree(Path(tmp) / "tree", commit)
            out = Path(tmp) / "out.json"
            cmd = [sys.executable, __file__, "--tree", str(tree), "--commit", commit, "--out", str(out)]
            cmd += ["--layouts", ",".join(layouts), "--fixture", str(FIXTURE) if fixture else ""]
            proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"the pinned commit's run failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
                )
            os.replace(out, path)
    return json.loads(path.read_text())


def reference_for(got, recorded, pinned, where: str, commit: str = PINNED):
    """The reference ``got`` must equal bitwise, and a line saying where it came from.

    ``recorded`` is this machine key's entry in a committed file (None where there is none),
    ``pinned`` a function returning the pinned commit's entry run here (``commit``: which one). The
    file decides when ``got`` equals it; otherwise the pinned commit's bits here decide which
    reference holds: the file's, if they agree with it (the change under test moved a bit), or their
    own, if the file was recorded on a machine whose kernels round differently under the same key.
    """
    if recorded is not None and got == recorded:
        return recorded, where
    ref = pinned()
    if recorded is None:
        return ref, f"pinned commit {commit[:7]} run here (no entry for this machine in {where})"
    if ref == recorded:
        return recorded, f"{where} (the pinned commit {commit[:7]} gives the same bits here)"
    source = f"pinned commit {commit[:7]} run here ({where} holds another machine's bits)"
    warnings.warn(f"{source}: this machine's key does not separate it from the file's", stacklevel=2)
    return ref, source


def _child(commit: str, names: list[str], fixture: Path | None, out: Path) -> None:
    """Runs in the pinned tree: the golden layouts ``names``, then (given a ``fixture``) the
    fixture resumed at 2 ranks."""
    import shutil

    import torch

    torch.set_num_threads(1)
    from golden_runs import run_layout  # the pinned tree's
    from multiproc import run_ranks
    from trainrun import compose_tree, train

    result = {"commit": commit, "layouts": {name: run_layout(name) for name in names}}
    if fixture is not None:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Path(tmp) / fixture.name
            shutil.copytree(fixture, ckpt)
            fixture_tree = compose_tree(["dist.world_size=2", f"checkpoint.resume={ckpt}"])
            losses = run_ranks(train, 2, fixture_tree, str(Path(tmp) / "run"))[0]["losses"]
        result["fixture"] = {str(k): v for k, v in losses.items()}
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    if sorted(args) != ["--commit", "--fixture", "--layouts", "--out", "--tree"]:
        print(__doc__)
        sys.exit(2)
    tree = Path(args["--tree"]).resolve()
    sys.path[:] = [str(tree), str(tree / "tests"), *sys.path[1:]]  # the pinned tree's distlib, not ours
    fixture = Path(args["--fixture"]) if args["--fixture"] else None
    _child(args["--commit"], args["--layouts"].split(","), fixture, Path(args["--out"]))
