"""docs/config.md is what the config code says: regenerated here, it must equal the committed file,
and it names every key with its real default."""

from distlib.app.config import schema
from distlib.app.config.run import GROUPS, RunConfig
from distlib.launch import config_reference


def test_docs_config_md_is_not_stale():
    assert config_reference.DOC.read_text() == config_reference.render(), (
        "docs/config.md is stale: run `make config-doc` (python -m distlib.launch.config_reference)"
    )


def test_every_key_appears_with_its_default():
    text = config_reference.render()
    keys = [(f"{g}.{s.name}", s) for g, cls in GROUPS.items() for s in schema.specs(cls)]
    keys += [(s.name, s) for s in schema.specs(RunConfig)]
    for name, spec in keys:
        assert f"| `{name}` | `{config_reference._value(spec.default)}` |" in text, name


def test_the_check_mode_names_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    monkeypatch.setattr(config_reference, "DOC", stale)
    assert config_reference.main(["--check"]) == 1
    assert "is stale: run `make config-doc`" in capsys.readouterr().err
    assert config_reference.main([]) == 0 and config_reference.main(["--check"]) == 0
