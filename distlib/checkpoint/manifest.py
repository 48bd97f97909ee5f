"""What a well-formed manifest is, checked once when it is read.

Every reader (resume, resharding, consolidation, inspection, sampling) indexes the manifest
directly: ``manifest["layout"]["params"][i]["shape"]``, ``numel // world_size``, one shard file
per rank. A manifest edited by hand, or written by a buggy tool, would otherwise surface far from
its cause as a KeyError, a ZeroDivisionError or a wrong-sized tensor. ``check`` names the first
field that is wrong, by its path (``layout.params[3] lacks "shape"``, ``world_size must be >= 1,
got 0``), and ``sharded.read_manifest`` turns that into one CheckpointError line.

The rules are the ones the writers follow: ``sharded.save`` (one shard per rank, in rank order,
and the run-level ``extra_files`` at plain relative paths that are neither a shard nor the
manifest), ``FlatLayout.to_dict`` (contiguous parameters, derived sizes) and the tensor-parallel
``manifest_layouts`` (one layout per tensor rank, each split naming that rank).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import PurePosixPath

from distlib.comm.layout import DIMENSIONS, Layout, LayoutError

# train.dtype's values (distlib.app.config.run.DTYPES; this layer may not import the application).
PARAM_DTYPES = ("fp32", "bf16")
ZERO_STAGES = (0, 1, 2, 3)
MANIFEST_NAME = "manifest.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestProblem(ValueError):
    """The first thing wrong with a manifest, naming the field by its path."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a count


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _field(obj: dict, key: str, where: str, kind: type | tuple, optional: bool = False):
    """obj[key], which must be of ``kind``; ``where`` is obj's own path ("" at the top)."""
    name = f"{where}.{key}" if where else key
    if key not in obj:
        if optional:
            return None
        raise ManifestProblem(f'{where or "manifest"} lacks "{key}"')
    value = obj[key]
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        what = {int: "an integer", str: "a string", list: "a list", dict: "an object"}.get(
            kind, "an object or null"
        )
        raise ManifestProblem(f"{name} must be {what}, got {_show(value)}")
    return value


def _count(obj: dict, key: str, where: str, minimum: int, optional: bool = False) -> int | None:
    value = _field(obj, key, where, int, optional)
    if value is not None and value < minimum:
        raise ManifestProblem(f"{f'{where}.{key}' if where else key} must be >= {minimum}, got {value}")
    return value


def _shape(value, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(n) and n >= 0 for n in value):
        raise ManifestProblem(f"{name} must be a list of sizes >= 0, got {_show(value)}")
    return tuple(value)


def _parallel(manifest: dict, world: int, tp: int, pp: int) -> Layout:
    """The layout the manifest's sizes give; its ``parallel`` record, when present, must be it (and
    gives the degree of every other dimension, by name: 1 where it has none)."""
    record = _field(manifest, "parallel", "", dict, optional=True)
    degrees = {"tp": tp, "pp": pp}
    if record is not None:
        degrees |= {d.name: record.get(d.name, 1) for d in DIMENSIONS if d.name not in degrees}
    try:
        layout = Layout.of(world, **degrees)
    except (LayoutError, TypeError) as exc:
        raise ManifestProblem(f"parallel: {exc}") from None
    if record is not None:
        try:
            recorded = Layout.from_dict(record)
        except (LayoutError, TypeError, ValueError) as exc:
            raise ManifestProblem(f"parallel: {exc}") from None
        if recorded != layout:
            raise ManifestProblem(
                f"parallel {_show(record)} disagrees with world_size {world}, tp {tp}, pp {pp}"
            )
    return layout


def check_layout(layout, where: str, world_size: int, tp: int | None = None, tp_rank: int = 0) -> None:
    """A FlatLayout dict over ``world_size`` ranks: parameters back to back from offset 0, sizes
    that follow from them. With ``tp``, also each parameter's full shape and its split for
    tensor rank ``tp_rank`` (as ``tensor_parallel.manifest_layouts`` writes them)."""
    if not isinstance(layout, dict):
        raise ManifestProblem(f"{where} must be an object, got {_show(layout)}")
    params = _field(layout, "params", where, list)
    offset = 0
    for i, p in enumerate(params):
        at = f"{where}.params[{i}]"
        if not isinstance(p, dict):
            raise ManifestProblem(f"{at} must be an object, got {_show(p)}")
        _field(p, "name", at, str)
        shape = _shape(_field(p, "shape", at, list), f"{at}.shape")
        if _count(p, "offset", at, 0) != offset:
            raise ManifestProblem(
                f"{at}.offset is {p['offset']}, expected {offset} (parameters lie back to back)"
            )
        if _count(p, "numel", at, 0) != math.prod(shape):
            raise ManifestProblem(
                f"{at}.numel is {p['numel']}, but its shape {list(shape)} holds {math.prod(shape)}"
            )
        offset += p["numel"]
        if tp is not None:
            _check_split(p, at, shape, tp, tp_rank)
    if len({p["name"] for p in params}) != len(params):
        raise ManifestProblem(f"{where}.params names a parameter twice")
    shard = -(-offset // world_size)
    derived = {
        "numel": offset,
        "world_size": world_size,
        "shard_numel": shard,
        "padded_numel": shard * world_size,
        "padding": shard * world_size - offset,
    }
    for key, value in derived.items():
        if _count(layout, key, where, 0) != value:
            raise ManifestProblem(f"{where}.{key} is {layout[key]}, expected {value}")
    if _field(layout, "dtype", where, str) != "float32":  # the master weights and Adam state
        raise ManifestProblem(f"{where}.dtype must be 'float32', got {_show(layout['dtype'])}")


def _check_group_holdings(manifest: dict, world: int, tp: int) -> None:
    """``group_holdings`` (optional): the other parameter groups' flat layouts (experts), each with
    its key prefix, tensor rank and the distinct files holding its partitions."""
    for i, held in enumerate(_field(manifest, "group_holdings", "", list, optional=True) or []):
        at = f"group_holdings[{i}]"
        if not isinstance(held, dict):
            raise ManifestProblem(f"{at} must be an object, got {_show(held)}")
        prefix = _field(held, "prefix", at, str)
        if not prefix.endswith(".") or prefix == ".":
            raise ManifestProblem(f"{at}.prefix must be a group name and a dot, got {_show(prefix)}")
        tp_rank = _count(held, "tp_rank", at, 0)
        files = _field(held, "files", at, list)
        if (
            not files
            or any(not _is_int(f) or not 0 <= f < world for f in files)
            or len(set(files)) < len(files)
        ):
            raise ManifestProblem(f"{at}.files must be distinct ranks 0..{world - 1}, got {_show(files)}")
        check_layout(
            _field(held, "layout", at, dict), f"{at}.layout", len(files), tp if tp > 1 else None, tp_rank
        )


def _check_split(p: dict, at: str, shape: tuple[int, ...], tp: int, tp_rank: int) -> None:
    full = _shape(_field(p, "full_shape", at, list), f"{at}.full_shape")
    split = _field(p, "split", at, (dict, type(None)))
    if split is None:
        if full != shape:
            raise ManifestProblem(
                f"{at}: replicated (split null) but shape {list(shape)} != full_shape {list(full)}"
            )
        return
    dim, parts, index, groups = (
        _count(split, k, f"{at}.split", 0) for k in ("dim", "parts", "index", "groups")
    )
    if parts != tp or index != tp_rank or dim >= len(shape) or groups < 1 or shape[dim] % groups:
        raise ManifestProblem(
            f"{at}.split {split} does not fit tensor rank {tp_rank} of {tp} for shape {list(shape)}"
        )
    expected = tuple(n * parts if d == dim else n for d, n in enumerate(shape))
    if full != expected:
        raise ManifestProblem(f"{at}.full_shape is {list(full)}, expected {list(expected)} for split {split}")


def extra_dirs(names: list[str]) -> set[str]:
    """Every directory (a relative POSIX path) that holds one of the extra files ``names``."""
    return {str(p) for name in names for p in PurePosixPath(name).parents if str(p) != "."}


def check_extra_names(names: list[str], reserved: set[str]) -> None:
    """Extra files' paths: relative, inside the checkpoint (no "..", no hidden or empty part), none
    of ``reserved`` (the shards' and the manifest's names) at the top, each once, none both a file
    and the directory of another."""
    for i, name in enumerate(names):
        parts = name.split("/")
        if "\\" in name or any(not part or part.startswith(".") for part in parts):
            raise ManifestProblem(
                f"extra_files[{i}].path must be a relative path inside the checkpoint (no leading '/', "
                f"no '..', no hidden or empty part), got {_show(name)}"
            )
        if parts[0] in reserved:
            raise ManifestProblem(
                f"extra_files[{i}].path is {_show(name)}, a name the checkpoint uses for its shards "
                f"or its manifest"
            )
    if len(set(names)) != len(names):
        raise ManifestProblem("extra_files names a file twice")
    both = sorted(set(names) & extra_dirs(names))
    if both:
        raise ManifestProblem(f"extra_files lists {both[0]!r} as a file and as the directory of another")


def _check_extra_files(manifest: dict, reserved: set[str]) -> None:
    extras = _field(manifest, "extra_files", "", list, optional=True)
    if extras is None:
        return  # a checkpoint without run-level files, or one written before they existed
    for i, entry in enumerate(extras):
        at = f"extra_files[{i}]"
        if not isinstance(entry, dict):
            raise ManifestProblem(f"{at} must be an object, got {_show(entry)}")
        _field(entry, "path", at, str)
        _count(entry, "bytes", at, 0)
        if not _SHA256.fullmatch(_field(entry, "sha256", at, str)):
            raise ManifestProblem(
                f"{at}.sha256 must be 64 lowercase hex digits, got {_show(entry['sha256'])}"
            )
    check_extra_names([e["path"] for e in extras], reserved)


def check(manifest, shard_name: Callable[[int], str]) -> None:
    """Raise ManifestProblem for the first malformed field of a parsed ``manifest``; files must be
    ``shard_name(r)`` for every rank r, in rank order. (format_version is the caller's.)"""
    if not isinstance(manifest, dict):
        raise ManifestProblem(f"a manifest is a JSON object, got {_show(manifest)}")
    _count(manifest, "step", "", 0)
    world = _count(manifest, "world_size", "", 1)
    stage = _field(manifest, "zero_stage", "", int)
    if stage not in ZERO_STAGES:
        raise ManifestProblem(f"zero_stage must be one of {list(ZERO_STAGES)}, got {stage}")
    _field(manifest, "model", "", dict)
    dtype = _field(manifest, "param_dtype", "", str, optional=True)
    if dtype is not None and dtype not in PARAM_DTYPES:
        raise ManifestProblem(f"param_dtype must be one of {list(PARAM_DTYPES)}, got {_show(dtype)}")
    tp = _count(manifest, "tp", "", 1, optional=True) or 1
    if world % tp:
        raise ManifestProblem(f"world_size {world} is not a multiple of tp {tp}")
    pp = _count(manifest, "pp", "", 1, optional=True) or 1
    if world % (tp * pp):
        raise ManifestProblem(f"world_size {world} is not a multiple of tp {tp} x pp {pp}")
    dp = _count(manifest, "dp", "", 1, optional=True)
    # A resharded tp == 1 checkpoint may carry its source's dp (older ckpt.py reshard copied it);
    # nothing reads dp when tp == 1, so such checkpoints stay readable.
    stale_ok = tp == 1 and "resharded_from" in manifest
    grid = _parallel(manifest, world, tp, pp)
    cp = grid.cp
    if dp is not None and dp != grid.dp and not stale_ok:  # the data-parallel ranks the grid leaves
        raise ManifestProblem(
            f"dp {dp} x tp {tp}"
            + (f" x pp {pp}" if pp > 1 else "")
            + (f" x cp {cp}" if cp > 1 else "")
            + f" != world_size {world}"
        )
    layouts = _field(manifest, "tp_layouts", "", list, optional=tp == 1)
    if layouts is not None and len(layouts) != tp:
        raise ManifestProblem(f"tp_layouts has {len(layouts)} layout(s), expected one per tensor rank ({tp})")
    per_layout = grid.partitions().dp  # ranks holding one flat layout's partitions
    check_layout(_field(manifest, "layout", "", dict), "layout", per_layout)
    for t, layout in enumerate(layouts or []):
        check_layout(layout, f"tp_layouts[{t}]", per_layout, tp, t)
    stages = _field(manifest, "pp_layouts", "", list, optional=pp == 1)
    if stages is not None and len(stages) != pp:
        raise ManifestProblem(
            f"pp_layouts has {len(stages)} stage(s), expected one per pipeline stage ({pp})"
        )
    for s, per_tp in enumerate(stages or []):
        if not isinstance(per_tp, list) or len(per_tp) != tp:
            raise ManifestProblem(f"pp_layouts[{s}] must list one layout per tensor rank ({tp})")
        for t, layout in enumerate(per_tp):
            check_layout(layout, f"pp_layouts[{s}][{t}]", per_layout, tp if tp > 1 else None, t)
    _check_group_holdings(manifest, world, tp)
    files = _field(manifest, "files", "", list)
    if len(files) != world:
        raise ManifestProblem(f"files lists {len(files)} file(s), expected one shard per rank ({world})")
    for r, entry in enumerate(files):
        at = f"files[{r}]"
        if not isinstance(entry, dict):
            raise ManifestProblem(f"{at} must be an object, got {_show(entry)}")
        if _field(entry, "path", at, str) != shard_name(r):
            raise ManifestProblem(
                f"{at}.path is {_show(entry['path'])}, expected {shard_name(r)!r} "
                f"(one shard per rank, in rank order, inside the checkpoint)"
            )
        if _count(entry, "rank", at, 0, optional=True) not in (None, r):
            raise ManifestProblem(f"{at}.rank is {entry['rank']}, expected {r}")
        _count(entry, "bytes", at, 0)
        if not _SHA256.fullmatch(_field(entry, "sha256", at, str)):
            raise ManifestProblem(
                f"{at}.sha256 must be 64 lowercase hex digits, got {_show(entry['sha256'])}"
            )
    _check_extra_files(manifest, {shard_name(r) for r in range(world)} | {MANIFEST_NAME})
