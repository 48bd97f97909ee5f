"""A stopped run continues from its own record: ``checkpoint.resume=latest hydra.run.dir=<run>``.

The line every stop prints names only the run. Its settings are the ones the run started with,
as recorded in ``<run>/.hydra/config.yaml`` (the composed config) and ``overrides.yaml``, not
conf/'s defaults: so a continuation starts from that record, and what its own command line sets on
purpose is applied on top. Such a change is recorded beside the original, in
``<run>/.hydra/continue-<k>/`` (the same three files), never over it; the newest record is the one
the next continuation starts from (fault.* drills excepted: they are what each start's own command
line says). What an override changes is computed by Hydra itself: conf/
composed with the run's overrides, then with this command's added, and every key whose value
differs is set on the recorded tree (a group choice such as ``zero=stage3`` is its keys).
"""

from __future__ import annotations

from pathlib import Path

from distlib.app.checkpointing.manifest_config import NO_RESUME
from distlib.checkpoint import sharded as checkpoint

SUBDIR = ".hydra"
_RESUME = "checkpoint.resume"


def records(run_dir: Path) -> list[Path]:
    """The run's config records, oldest first: ``.hydra`` then ``.hydra/continue-1``, ... ."""
    base = run_dir / SUBDIR
    if not (base / "config.yaml").is_file():
        return []
    later = [p for p in base.glob("continue-*") if p.name.split("-", 1)[1].isdigit()]
    return [base, *sorted(later, key=lambda p: int(p.name.split("-", 1)[1]))]


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _changes(before, after, path=()) -> list[tuple[tuple[str, ...], object]]:
    if isinstance(before, dict) and isinstance(after, dict):
        return [c for k in after for c in _changes(before.get(k), after[k], (*path, k))]
    return [] if before == after else [(path, after)]


def continued(tree: dict, run_dir: Path, overrides: list[str]) -> tuple[dict, list[str]] | None:
    """For a resume into a run that recorded its config: (the tree to run, the overrides that
    changed something, ``[]`` when none did). None for anything else (a fresh run, or no record)."""
    from omegaconf import OmegaConf

    from distlib.launch.hydra_config import compose_tree

    found = records(run_dir)
    if tree["checkpoint"]["resume"] in NO_RESUME or not found:
        return None
    recorded = OmegaConf.to_container(OmegaConf.load(found[-1] / "config.yaml"), resolve=True)
    new = [o for o in overrides if _key(o) != _RESUME]
    original = [o for o in OmegaConf.load(found[-1] / "overrides.yaml") if _key(o) != _RESUME]
    base = [o for o in original if _key(o) not in {_key(n) for n in new}]
    # the keys the command line changes, not what completing reads elsewhere (a resume's record has it)
    changes = _changes(compose_tree(original, completed=False), compose_tree(base + new, completed=False))
    for path, value in changes:
        node = recorded
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    recorded["checkpoint"]["resume"] = tree["checkpoint"]["resume"]
    recorded["fault"] = tree["fault"]  # a drill is what this start is told, not the run's setting
    return recorded, (base + new if changes else [])


def recorded_overrides(run_dir: Path) -> list[str]:
    """The overrides of the run's newest record (what a continuation's tree was set with), or []."""
    from omegaconf import OmegaConf

    found = records(run_dir)
    return list(OmegaConf.load(found[-1] / "overrides.yaml")) if found else []


def starts_fresh(tree: dict, run_dir: Path) -> bool:
    """Whether the run starts at step 0: no checkpoint.resume, or ``latest`` with no committed
    checkpoint in its directory yet."""
    resume = tree["checkpoint"]["resume"]
    if resume == "latest":
        return not checkpoint.list_committed(run_dir / str(tree["checkpoint"]["dir"]))
    return resume in NO_RESUME


def save_record(run_dir: Path, tree: dict, overrides: list[str]) -> Path:
    """The continuation's config and overrides beside the original (written whole, then renamed)."""
    import os

    from omegaconf import OmegaConf

    k = len(records(run_dir))
    final = run_dir / SUBDIR / f"continue-{k}"
    staging = final.with_name(f".{final.name}.partial-{os.getpid()}")
    staging.mkdir(parents=True)
    (staging / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(tree)), encoding="utf-8")
    (staging / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)), encoding="utf-8")
    os.replace(staging, final)
    return final


def finished(tree: dict, run_dir: Path) -> str | None:
    """The line for a resume at or past ``train.steps``: nothing would be trained. None otherwise."""
    resume, steps = tree["checkpoint"]["resume"], tree["train"]["steps"]
    if resume == "latest":
        committed = checkpoint.list_committed(run_dir / tree["checkpoint"]["dir"])
        newest = committed[-1] if committed else None
    else:
        newest = None if resume in NO_RESUME else Path(resume)
    if newest is None or not newest.name.startswith("step_") or not newest.name[5:].isdigit():
        return None
    step = int(newest.name[5:])
    if step < steps:
        return None
    try:  # a damaged one is not the end: the workers report it (and with latest fall back)
        checkpoint.verify(newest)
    except checkpoint.CheckpointError:
        return None
    return (
        f"nothing to train: {newest} is at step {step} and train.steps={steps}; "
        f"pass train.steps=N with N > {step} to train further (the run is left as it is)"
    )


def resume_path_problem(tree: dict) -> str | None:
    """What is wrong with an explicit ``checkpoint.resume`` path, found before any worker starts
    (a run directory given for a checkpoint names its checkpoints and the line to use); None if
    it is a committed checkpoint, or not a path."""
    resume = tree["checkpoint"]["resume"]
    if resume in NO_RESUME or resume == "latest":
        return None
    path = Path(resume)
    if (path / checkpoint.MANIFEST).is_file():
        return None
    if not path.exists():
        return f"checkpoint.resume={resume} does not exist"
    held = checkpoint.list_committed(path / tree["checkpoint"]["dir"])
    if held:
        names = held[0].name + (f" ... {held[-1].name}" if len(held) > 1 else "")
        return (
            f"checkpoint.resume={resume} is a run directory, not a checkpoint (it holds {len(held)} "
            f"checkpoint(s): {names}); continue that run with checkpoint.resume=latest "
            f"hydra.run.dir={resume}, or name one: checkpoint.resume={held[-1]}"
        )
    return f"checkpoint.resume={resume} is not a committed checkpoint: it has no {checkpoint.MANIFEST}"


def resumed_on_restart(tree: dict, attempt: int) -> tuple[dict, str | None]:
    """A restart of a torchrun job (``attempt`` > 0, the start number the ranks agreed) continues
    the job's own checkpoints: with ``checkpoint.resume`` unset it resumes from the latest one (or,
    where the first start saved none, starts fresh, as ``latest`` does). (the tree to run, the line
    rank 0 prints, or None where nothing changed.) Without this, ``--max-restarts`` restarted
    nothing once a checkpoint was saved: the restart found the first start's checkpoints, refused
    to start a fresh run over them and exited 1. Its first start refuses to start over anything
    older, so whatever a restart finds was saved by this job."""
    if attempt == 0 or tree.get("checkpoint", {}).get("resume") not in NO_RESUME:
        return tree, None
    tree = {**tree, "checkpoint": {**tree["checkpoint"], "resume": "latest"}}
    return tree, (
        f"restart {attempt} of the job: {_RESUME} was not set, so it resumes from the latest "
        f"checkpoint ({_RESUME}=latest)"
    )
