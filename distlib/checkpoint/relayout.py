"""One way to move optimizer state between layouts: by parameter name and global element.

A checkpoint is a set of *holdings*: flat fp32 vectors in ``FlatLayout`` coordinates, each
partitioned over some of its files. There is one per pipeline stage and tensor rank, partitioned
over the batch ranks dp x cp (manifest ``layout``, ``tp_layouts[t]`` or ``pp_layouts[s][t]``;
files in the layout's rank order, distlib/comm/layout.py). Each slot of a holding is one
parameter's local piece: the whole tensor, or what a tensor-parallel ``Split`` cuts from it
(``shard_of``). So every saved element stands for (parameter name, global element index), and the
global indices of a piece's elements, in its order, are ``shard_of`` of the parameter's ``arange``.

Loading partition r of W of any flat layout, its pieces cut by any splits (another dp, cp, tp or
pp degree, any ZeRO stage, or the whole model on one rank for the offline tools), is one plan
(``plan``): for each parameter the partition needs, the global elements it wants as runs of
consecutive elements (distlib/checkpoint/runs.py), matched with the runs each holding keeps (a
replicated parameter is read from the loading rank's tensor rank if the checkpoint has it, else
from tensor rank 0), and so the files and offsets there. Each needed file is then opened once and
the span of offsets it serves is read (a safetensors slice, not the whole file unless the span is)
and copied into place (``read_partition``). Copies only: the loaded bits are the saved bits.

The plan takes host memory in proportion to its runs (a few per parameter cut along dim 0, one
per row cut along the last dim), not to elements.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import torch

from distlib.checkpoint import runs, sharded
from distlib.checkpoint.runs import Runs
from distlib.checkpoint.sharded import CheckpointError
from distlib.comm.layout import Layout
from distlib.parallel.adamw import STATE_KEYS
from distlib.parallel.flat_layout import FlatLayout, ParamSlot
from distlib.parallel.tensor_parallel import Split, full_shape

HOST = torch.device("cpu")  # plans and reads are host work; the optimizer moves the state to its device


@dataclass(frozen=True)
class Piece:
    """One slot of a holding: parameter ``name``'s piece cut by ``split`` (None: whole)."""

    name: str
    offset: int  # in the holding's flat vector
    full_shape: tuple[int, ...]
    split: Split | None


@dataclass(frozen=True)
class Holding:
    """One saved flat vector: its pieces, its real length, the file holding each partition, the
    tensor rank that saved it, and the prefix of its state's keys in those files."""

    pieces: tuple[Piece, ...]
    numel: int
    files: tuple[int, ...]
    tp_rank: int = 0
    prefix: str = ""

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // len(self.files))


@dataclass(frozen=True)
class Place:
    """Where a loading rank sits: partition ``rank`` of ``world`` of its flat ``layout``, whose
    pieces ``splits`` cuts (parameter name -> Split; absent: whole), at pipeline stage ``stage`` of
    ``stages`` and tensor rank ``tp_rank`` of ``tp`` (these say whose RNG state it takes)."""

    layout: FlatLayout
    rank: int = 0
    world: int = 1
    splits: dict[str, Split] = field(default_factory=dict)
    stage: int = 0
    stages: int = 1
    tp_rank: int = 0
    tp: int = 1


def stage_layouts(manifest: dict) -> list[list[dict]]:
    """[stage][tp_rank] -> that holding's flat layout dict (one stage without pipelining)."""
    return manifest.get("pp_layouts") or [manifest.get("tp_layouts") or [manifest["layout"]]]


def _piece(p: dict) -> Piece:
    split = Split(**p["split"]) if p.get("split") else None
    whole = p.get("full_shape") or full_shape(tuple(p["shape"]), split)
    return Piece(p["name"], int(p["offset"]), tuple(whole), split)


def holdings(manifest: dict) -> list[Holding]:
    """The checkpoint's holdings: the first parameter group's stage by stage, tensor rank by tensor
    rank, then the other groups' (``group_holdings``: expert parallelism's experts)."""
    grid = Layout.of_manifest(manifest).partitions()  # the flat layouts' partitions: dp x cp
    out = []
    for s, per_tp in enumerate(stage_layouts(manifest)):
        for t, layout in enumerate(per_tp):
            files = tuple(grid.rank(pp=s, dp=b, tp=t) for b in range(grid.dp))
            pieces = tuple(_piece(p) for p in layout["params"])
            out.append(Holding(pieces, int(layout["numel"]), files, t))
    for held in manifest.get("group_holdings", []):
        pieces = tuple(_piece(p) for p in held["layout"]["params"])
        files, tp_rank = tuple(held["files"]), int(held.get("tp_rank", 0))
        out.append(Holding(pieces, int(held["layout"]["numel"]), files, tp_rank, held["prefix"]))
    return out


def whole_layout(manifest: dict, world: int = 1) -> FlatLayout:
    """Every parameter of the checkpoint's model, whole, once: the first group's stage by stage,
    then the other groups' (in the order the manifest lists them)."""
    slots, offset, seen = [], 0, set()
    for held in holdings(manifest):
        for piece in held.pieces:
            if piece.name not in seen:
                seen.add(piece.name)
                slots.append(ParamSlot(piece.name, piece.full_shape, offset))
                offset += math.prod(piece.full_shape)
    return FlatLayout(tuple(slots), world)


class Sources:
    """Where a checkpoint keeps each parameter's elements."""

    def __init__(self, held: list[Holding], path: Path):
        self.held, self.path = held, path
        self.pieces: dict[str, list[tuple[int, Piece]]] = {}
        for h, holding in enumerate(held):
            for piece in holding.pieces:
                self.pieces.setdefault(piece.name, []).append((h, piece))

    def locate(self, name: str, shape: tuple[int, ...], wanted: Runs, tp_rank: int = 0) -> dict[int, Runs]:
        """holding -> runs (start: flat position there, at: ``wanted``'s) of the global elements
        ``wanted`` of parameter ``name``; an element several holdings keep (a replicated parameter)
        is read from tensor rank ``tp_rank``'s when it has one (the loading rank's own file at the
        same layout), else from the first."""
        if name not in self.pieces:
            raise CheckpointError(f"checkpoint {self.path} has no parameter {name}")
        theirs = self.pieces[name][0][1].full_shape
        if theirs != tuple(shape):
            raise CheckpointError(
                f"checkpoint {self.path}: parameter {name} has shape {list(theirs)}, "
                f"the model's is {list(shape)}"
            )
        found: dict[int, list[Runs]] = {}
        pieces = sorted(self.pieces[name], key=lambda hp: self.held[hp[0]].tp_rank != tp_rank)
        for h, piece in pieces:
            if not len(wanted):
                break
            theirs = runs.piece_runs(shape, piece.split).shifted(piece.offset)
            matched, wanted = runs.intersect(wanted, theirs)
            found.setdefault(h, []).append(matched)
        if len(wanted):
            raise CheckpointError(f"checkpoint {self.path}: no holding covers all of parameter {name}")
        return {h: runs.concat(parts) for h, parts in found.items()}


def plan(sources: Sources, place: Place) -> dict[tuple[int, str], Runs]:
    """(file rank, key prefix) -> runs (start: offset in that file's vectors, at: position in the
    partition) of every real element of ``place``'s partition; the rest of the partition is padding."""
    layout = place.layout
    size = -(-layout.numel // place.world)
    lo, hi = place.rank * size, min((place.rank + 1) * size, layout.numel)
    reads: dict[tuple[int, str], list[Runs]] = {}
    for slot in layout.slots:
        if max(lo, slot.offset) >= min(hi, slot.offset + slot.numel):
            continue
        split = place.splits.get(slot.name)
        shape = full_shape(slot.shape, split)
        wanted = runs.piece_runs(shape, split).shifted(slot.offset - lo).window(0, hi - lo)
        for h, found in sources.locate(slot.name, shape, wanted, place.tp_rank).items():
            held = sources.held[h]
            for d, part in runs.by_partition(found, held.shard_numel).items():
                reads.setdefault((held.files[d], held.prefix), []).append(part)
    return {f: runs.concat(r) for f, r in sorted(reads.items())}


def open_shard(path: Path, rank: int):
    try:
        return safetensors.safe_open(str(path / sharded.shard_name(rank)), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"checkpoint {path}: cannot read {sharded.shard_name(rank)}: {exc}") from exc


def read_partition(
    path: Path, manifest: dict, place: Place, keys: Sequence[str] = STATE_KEYS, sources: Sources | None = None
) -> dict[str, torch.Tensor]:
    """``place``'s partition of each of ``keys`` (padded, on the host) from a verified checkpoint
    (``sources``: its holdings, when the caller has them already)."""
    path = Path(path)
    sources = sources or Sources(holdings(manifest), path)
    size = -(-place.layout.numel // place.world)
    state = {key: torch.zeros(size, dtype=torch.float32, device=HOST) for key in keys}
    for (file, prefix), reads in plan(sources, place).items():
        lo, hi = int(reads.start[0]), int((reads.start + reads.length).max())
        with open_shard(path, file) as f:
            for key in keys:
                runs.copy(state[key], f.get_slice(prefix + key)[lo:hi], reads, base=lo)
    return state


def rank_state(path: Path, manifest: dict, place: Place) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """(rank_state, RNG tensors) for ``place``: the RNG of the rank at the same place, when the
    checkpoint's pipeline and tensor degrees are the run's and it had that batch rank; else None
    (the caller re-seeds and says so)."""
    grid = Layout.of_manifest(manifest).partitions()
    same = (grid.pp, grid.tp) == (place.stages, place.tp) and place.rank < grid.dp
    own = grid.rank(pp=place.stage, dp=place.rank, tp=place.tp_rank) if same else 0
    with open_shard(Path(path), own) as f:
        state = json.loads(f.metadata()["rank_state"])
        rng = {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng.")}
    if not same or not rng or state.get("rng") is None:
        state["rng"], rng = None, None
    return state, rng


def load(path: Path, manifest: dict, places: dict[str, Place]):
    """(state, rank_state, rng) for a rank holding a partition at each of ``places`` (key prefix ->
    place; the RNG goes with the first's) from a verified checkpoint of any layout: state is each
    partition's STATE_KEYS under its prefix."""
    state, sources = {}, Sources(holdings(manifest), Path(path))
    for prefix, place in places.items():
        read = read_partition(path, manifest, place, sources=sources)
        state |= {prefix + k: v for k, v in read.items()}
    return state, *rank_state(path, manifest, next(iter(places.values())))


STATE_BUFFER = "buffer."  # a model state buffer's key in a shard (manifest ``state_buffers``)


def state_buffers(path: Path, manifest: dict, names=None) -> dict[str, torch.Tensor]:
    """The model state besides the parameters (the application's expert biases) of a verified
    checkpoint: each of ``names`` (default: all) read from the file the manifest's
    ``state_buffers`` names for it; {} for a checkpoint without any."""
    where = manifest.get("state_buffers") or {}
    names = list(where) if names is None else list(names)
    missing = [n for n in names if n not in where]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no state for {missing[0]} (of {len(missing)} missing)")
    by_file: dict[int, list[str]] = {}
    for n in names:
        by_file.setdefault(int(where[n]), []).append(n)
    out = {}
    for file, held in sorted(by_file.items()):
        with open_shard(Path(path), file) as f:
            out |= {n: f.get_tensor(STATE_BUFFER + n) for n in held}
    return out


def full_tensors(path: Path, manifest: dict, key: str = "master") -> dict[str, torch.Tensor]:
    """Every parameter of the whole model, fp32, named as the model names it, from the ``key``
    vector (one of STATE_KEYS: the weights, or an Adam moment) of a verified checkpoint."""
    if key not in STATE_KEYS:
        raise ValueError(f"key must be one of {STATE_KEYS}, got {key!r}")
    layout = whole_layout(manifest)
    flat = read_partition(path, manifest, Place(layout), (key,))[key]
    return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape).clone() for s in layout.slots}
