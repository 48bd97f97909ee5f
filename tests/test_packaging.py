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
