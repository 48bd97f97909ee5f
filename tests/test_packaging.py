import json
import subprocess
import sys

import tomllib
from e2e import ROOT


def test_requirements_pin_the_same_runtime_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [
        line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
    ]
    requirements = [r for r in requirements if r]
    assert sorted(project["dependencies"]) == sorted(requirements)
    assert "torch==2.13.0" in project["dependencies"]
    assert project["name"] != "distlib", "the distribution name must not collide with PyPI's distlib"


def test_dev_requirements_add_only_the_test_runner_and_declared_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements-dev.txt").read_text().splitlines()]
    lines = [line for line in lines if line]
    assert lines[0] == "-r requirements.txt"
    extras = {dep for group in project["optional-dependencies"].values() for dep in group}
    assert set(lines[1:]) <= extras | {"pytest>=8,<10"}, (
        "every dev requirement is the runner or a declared extra"
    )
    assert not any(line.startswith("torch") for line in lines[1:]), "nothing may re-pin torch"


def _closure(requirements: list[str]) -> set[str]:
    """Every distribution the installed ``requirements`` pull in, following each installed
    distribution's Requires-Dist with its markers evaluated (only the extras asked for count)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if (name, tuple(sorted(req.extras))) in seen:
            continue
        seen.add((name, tuple(sorted(req.extras))))
        for line in metadata.distribution(name).requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                todo.append(sub)
    return {name for name, _ in seen}


def test_the_hf_tensorboard_and_parquet_extras_install_no_torch_of_their_own():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = extras["hf"] + extras["tensorboard"] + extras["parquet"]
    # pip's own resolver, offline, with torch 2.13.0 installed: the extras (installed by `make`
    # from requirements-dev.txt) need nothing more, so no other torch either.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--quiet",
            "--report",
            "-",
            *pins,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"run `make venv` (requirements-dev.txt installs the extras): {proc.stderr}"
    assert [item["metadata"]["name"] for item in json.loads(proc.stdout)["install"]] == []
    # and nothing they depend on, however deep, asks for torch at all
    pulled = _closure(pins)
    assert {"transformers", "tokenizers", "tensorboard"} <= pulled and "torch" not in pulled, sorted(pulled)
