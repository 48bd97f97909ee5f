"""The configuration's defaults, handed to Hydra from the one place they are written.

Every key's default is declared once, in the application's config dataclasses
(``distlib.app.config``). ``register`` stores them in Hydra's ConfigStore as ``_defaults``, the
first entry of conf/config.yaml's defaults list, so the YAML files under conf/ hold only what a
choice changes (``zero=stage2`` sets ``stage: 2``; ``data=text`` sets the file and the held-out
share). The stored tree is plain (untyped): Hydra merges the command line into it as given,
``complete`` fills in what the run knows from elsewhere (model.init_from's architecture, the
tokenizer's vocabulary) where the command line leaves it, and ``RunConfig.from_dict`` checks
every key (one ``config error: <key> ...`` line).
"""

from __future__ import annotations

from pathlib import Path

from distlib.app.checkpointing import init_from, manifest_config
from distlib.app.checkpointing.manifest_config import NO_RESUME
from distlib.app.config import schema
from distlib.app.config.run import GROUPS, RunConfig, with_tokenizer_vocab

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
DEFAULTS_NAME = "_defaults"


def defaults_tree() -> dict:
    """Every group's keys with their defaults, and the top-level keys."""
    tree = {name: schema.defaults(cls) for name, cls in GROUPS.items()}
    tree.update(schema.defaults(RunConfig))
    return tree


def register() -> None:
    """Make ``_defaults`` known to Hydra (idempotent: the same node every time)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=DEFAULTS_NAME, node=defaults_tree())


def missing_choice(overrides: list[str]) -> str | None:
    """The first ``group=name`` override choosing a file conf/<group>/ does not hold, as one line
    naming the files it does (Hydra's own error spans twenty lines); None: every choice exists.
    Keys (``model.dim=8``), Hydra's own groups, deletions and sweeps (``model=gpt2,llama``) are
    left to Hydra."""
    for arg in overrides:
        group, equals, name = arg.lstrip("+~").partition("=")
        folder = CONF_DIR / group
        if not equals or "." in group or "/" in group or group == "hydra" or not folder.is_dir():
            continue
        if not name or name == "null" or any(c in name for c in ",[]()*$"):
            continue
        if not (folder / f"{name}.yaml").is_file():
            names = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
            return f"{group}={name}: conf/{group}/ has no {name}.yaml; {group} is one of {names}"
    return None


def compose(overrides: list[str] | None = None, return_hydra_config: bool = False):
    """conf/ composed with ``overrides`` as train.py composes it (tests and tools)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    if GlobalHydra.instance().is_initialized():  # inside train.py's Hydra app: its own search path
        return hydra_compose(
            config_name="config", overrides=list(overrides or []), return_hydra_config=return_hydra_config
        )
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(
            config_name="config", overrides=list(overrides or []), return_hydra_config=return_hydra_config
        )


def compose_tree(overrides: list[str] | None = None, *, completed: bool = True) -> dict:
    """``compose`` as a plain dict, interpolations resolved, and (``completed``) what the run knows
    filled in as train.py fills it (``complete``; a fresh start unless checkpoint.resume is given):
    what ``RunConfig.from_dict`` reads."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(compose(overrides), resolve=True)
    if not completed:
        return tree
    return complete(tree, list(overrides or []), fresh=tree["checkpoint"]["resume"] in NO_RESUME)


def set_on_purpose(tree: dict, overrides: list[str]) -> set[str]:
    """The dotted keys a run sets on purpose: each one the command line names (even at its default
    value), and each model key a choice gives another value than its default (``model=llama``:
    model.family; a preset: its shape)."""
    named = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    plain = defaults_tree()["model"]
    model = tree.get("model") or {}
    return named | {f"model.{k}" for k, v in model.items() if k in plain and v != plain[k]}


def complete(tree: dict, overrides: list[str], fresh: bool) -> dict:
    """``tree`` with what the run already knows in the keys ``overrides`` leave unset, so nothing is
    asked twice: on a ``fresh`` start, the model's architecture from model.init_from's config.json;
    resuming an explicit checkpoint, the model and tokenization from its manifest (a continuation
    with ``latest`` starts from the run's record); the model's vocabulary from the tokenizer.
    A key set to a value that disagrees stays as set: the configuration check names both values."""
    typed = set_on_purpose(tree, overrides)
    tree, taken = init_from.adopted(tree, typed) if fresh else manifest_config.adopted(tree, typed)
    return with_tokenizer_vocab(tree, typed | taken)


# A refused run must leave its directory as it found it, but Hydra writes .hydra/ (config.yaml,
# hydra.yaml, overrides.yaml) before calling the task. So a plain run asks Hydra for none
# (hydra.output_subdir=null, appended by train.py) and writes them itself once the config is
# valid and the run may start: the same three files, with output_subdir recorded as ".hydra".
SUBDIR = ".hydra"
NO_SUBDIR = "hydra.output_subdir=null"


def defers_files(argv: list[str], rank: str) -> bool:
    """Whether this process writes Hydra's files itself: a plain run (no -m or other Hydra flag),
    on rank 0, without an explicit hydra.output_subdir."""
    args = argv[1:]
    return not any(a.startswith("-") or a.startswith("hydra.output_subdir=") for a in args) and rank == "0"


def save_files(cfg, run_dir: Path, tree: dict | None = None) -> None:
    """Hydra's three files, as Hydra would have written them, into ``run_dir``/.hydra; config.yaml
    holds ``tree`` when given: the config as completed (``complete``), which a continuation of the
    run starts from without reading model.init_from again."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, flag_override

    hydra_cfg = OmegaConf.create(OmegaConf.to_container(HydraConfig.get()))  # a writable copy
    with flag_override(hydra_cfg, "readonly", False):
        hydra_cfg.output_subdir = SUBDIR
        hydra_cfg.overrides.hydra = [o for o in hydra_cfg.overrides.hydra if o != NO_SUBDIR]
    out = run_dir / SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    nodes = {
        "config.yaml": cfg if tree is None else OmegaConf.create(tree),
        "hydra.yaml": OmegaConf.create({"hydra": hydra_cfg}),
        "overrides.yaml": hydra_cfg.overrides.task,
    }
    for name, node in nodes.items():
        (out / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")


def given_run_dir(args: list[str]) -> tuple[str, bool] | None:
    """``hydra.run.dir`` as given on the command line, and whether it existed before this start."""
    for arg in args:
        if arg.startswith("hydra.run.dir="):
            value = arg.split("=", 1)[1]
            return value, Path(value).exists()
    return None


def drop_empty_run_dir(given: tuple[str, bool] | None) -> None:
    """A refused start leaves nothing behind: the run directory Hydra made for it is removed again
    if empty (a given one only if it did not exist before; the default outputs/<date>/<time> with
    its date directory and outputs/ when this start leaves them empty)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or (given and given[1]):
        return
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    for directory in [run_dir, *run_dir.parents][: 1 if given else 3]:
        try:
            directory.rmdir()  # an empty directory only
        except OSError:
            return
