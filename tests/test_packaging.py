import tomllib

from e2e import ROOT


def test_requirements_pin_the_same_runtime_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    requirements = [r for r in requirements if r and not r.startswith("pytest")]
    assert sorted(project["dependencies"]) == sorted(requirements)
    assert "torch==2.13.0" in project["dependencies"]
    assert project["name"] != "distlib", "the distribution name must not collide with PyPI's distlib"
