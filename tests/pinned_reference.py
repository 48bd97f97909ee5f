"""The pinned known-good commit's bits on this machine: the reference where no golden file fits.

Kernels round differently from one machine kind to another (tests/golden_runs.py says what the
golden files are keyed by), so a golden file holds one kind's bits. Anywhere else the bitwise
tests need bits computed here by code known to be good: PINNED, the commit the first golden files
were recorded from (before the layered-layout refactor). Its tree is taken with ``git archive``
(nothing is written into the repository or its .git), run by the current interpreter (the same
.venv, the same torch) in a subprocess whose ``sys.path`` holds that tree and not this one, and
the result is cached per (commit, torch, machine), so a machine pays for it once (~45 s here).

    .venv/bin/python tests/pinned_reference.py --tree DIR --fixture CKPT --out FILE   # the child
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
ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).with_name("fixtures") / "ckpt_v1_ws2_stage1_step10"


class Unavailable(Exception):
    """The pinned commit cannot be run here (no git, or no history holding it)."""


def _machine_id() -> str:
    """What the cache is kept for: the commit, torch, and the CPU as the kernels see it."""
    import torch

    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        import platform

        info = platform.processor() + platform.machine()
    lines = [x for x in info.splitlines() if x.split(":")[0].strip() in ("vendor_id", "model name", "flags")]
    text = "\n".join([PINNED, torch.__version__, torch.backends.cpu.get_cpu_capability(), *lines])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _pinned_tree(dest: Path) -> Path:
    """The pinned commit's files under ``dest`` (``git archive``: the repository is only read)."""
    try:
        proc = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", PINNED], capture_output=True, timeout=120
        )
    except FileNotFoundError:
        raise Unavailable("git is not installed, so the pinned commit cannot be checked out") from None
    if proc.returncode != 0:
        raise Unavailable(
            f"this checkout has no history holding the pinned commit {PINNED[:7]} (a shallow clone or a "
            f"source archive; `git fetch --unshallow` brings it): {proc.stderr.decode().strip()[:200]}"
        )
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def build(cache_dir: Path) -> dict:
    """The pinned commit's golden layouts and fixture resume, run on this machine (cached)."""
    from filelock import FileLock

    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"pinned-{_machine_id()}.json"
    with FileLock(str(path) + ".lock"):  # pytest-xdist workers: one builds, the others read
        if path.exists():
            return json.loads(path.read_text())
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            tree = _pinned_tree(Path(tmp) / "tree")
            out = Path(tmp) / "out.json"
            cmd = [
                sys.executable,
                __file__,
                "--tree",
                str(tree),
                "--fixture",
                str(FIXTURE),
                "--out",
                str(out),
            ]
            proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"the pinned commit's run failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
                )
            os.replace(out, path)
    return json.loads(path.read_text())


def reference_for(got, recorded, pinned, where: str):
    """The reference ``got`` must equal bitwise, and a line saying where it came from.

    ``recorded`` is this machine key's entry in a committed file (None where there is none),
    ``pinned`` a function returning the pinned commit's entry run here. The file decides when
    ``got`` equals it; otherwise the pinned commit's bits here decide which reference holds: the
    file's, if they agree with it (the change under test moved a bit), or their own, if the file
    was recorded on a machine whose kernels round differently under the same key.
    """
    if recorded is not None and got == recorded:
        return recorded, where
    ref = pinned()
    if recorded is None:
        return ref, f"pinned commit {PINNED[:7]} run here (no entry for this machine in {where})"
    if ref == recorded:
        return recorded, f"{where} (the pinned commit {PINNED[:7]} gives the same bits here)"
    source = f"pinned commit {PINNED[:7]} run here ({where} holds another machine's bits)"
    warnings.warn(f"{source}: this machine's key does not separate it from the file's", stacklevel=2)
    return ref, source


def _child(tree: Path, fixture: Path, out: Path) -> None:
    """Runs in the pinned tree: every golden layout, then the fixture resumed at 2 ranks."""
    import shutil

    import torch

    torch.set_num_threads(1)
    from golden_runs import LAYOUTS, run_layout  # the pinned tree's
    from multiproc import run_ranks
    from trainrun import compose_tree, train

    layouts = {name: run_layout(name) for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / fixture.name
        shutil.copytree(fixture, ckpt)
        fixture_tree = compose_tree(["dist.world_size=2", f"checkpoint.resume={ckpt}"])
        losses = run_ranks(train, 2, fixture_tree, str(Path(tmp) / "run"))[0]["losses"]
    result = {"commit": PINNED, "layouts": layouts, "fixture": {str(k): v for k, v in losses.items()}}
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    if sorted(args) != ["--fixture", "--out", "--tree"]:
        print(__doc__)
        sys.exit(2)
    tree = Path(args["--tree"]).resolve()
    sys.path[:] = [str(tree), str(tree / "tests"), *sys.path[1:]]  # the pinned tree's distlib, not ours
    _child(tree, Path(args["--fixture"]), Path(args["--out"]))
