"""The measured side of the pipeline: a real run's recorded events (2 forked gloo ranks, a toy
stack) drawn by scripts/pipeline_timeline.py into a valid PNG that shows the forwards and the
backwards of every chunk; the bubble fraction computed from events; the theory it is set against."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
import zlib
from pathlib import Path

import pytest
import torch
from forkrun import run_script
from multiproc import run_ranks
from torch import nn

from distlib.parallel.pipeline import executor, schedule
from distlib.parallel.pipeline.recorder import Recorder, bubble, theory

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
RUNS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
M, D = 4, 16


def _record(comm):
    torch.set_num_threads(1)
    out = []
    for name, v in RUNS:
        torch.manual_seed(0)
        stages = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(comm.size * v)]
        chunks = [stages[schedule.stage_of(comm.rank, c, comm.size)] for c in range(v)]
        for rec in (Recorder(comm.rank), Recorder(comm.rank)):  # the second step is kept
            executor.run(
                schedule.build(name, comm.size, M, v),
                chunks,
                comm,
                feed=lambda i: torch.ones(2, D) * i,
                loss_fn=lambda i, y: y.square().mean(),
                act_shape=(2, D),
                act_dtype=torch.float32,
                device="cpu",
                recorder=rec,
            )
        out.append(rec.events)
    return out


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + n]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])[0]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        idat += body if kind == b"IDAT" else b""
        pos += 12 + n
    assert kind == b"IEND" and zlib.decompress(idat)
    return size


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_timeline_png_from_a_real_run(tmp_path):
    import matplotlib.image
    import pipeline_timeline

    per_rank = run_ranks(_record, 2)
    runs = []
    for k, (name, v) in enumerate(RUNS):
        events = [e for r in per_rank for e in r[k]]
        assert len(events) == 2 * 2 * M * v and all(e["t_end"] >= e["t_start"] for e in events)
        runs.append(dict(schedule=name, pp=2, m=M, v=v, events=events))
    src = tmp_path / "events.json"
    src.write_text(json.dumps({"runs": runs}))
    proc = run_script("scripts/pipeline_timeline.py", str(src), "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for name, v in RUNS:
        png = tmp_path / f"pipeline_{name}_pp2.png"
        w, h = _png_size(png.read_bytes())
        assert w > 400 and h > 100
        image = matplotlib.image.imread(png)[: h * 3 // 5]  # the rows' part: the legend is at the bottom
        pixels = (image[..., :3] * 255).round().astype(int).reshape(-1, 3)
        present = {tuple(p) for p in pixels.tolist()}
        for colors in (pipeline_timeline.FORWARD, pipeline_timeline.BACKWARD):
            for c in range(v):  # each chunk's forwards and backwards are drawn
                rgb = tuple(int(colors[c][i : i + 2], 16) for i in (1, 3, 5))
                assert rgb in present, (name, colors[c])


def test_bubble_from_events():
    ev = [
        dict(rank=0, t_start=0.0, t_end=1.0),
        dict(rank=0, t_start=3.0, t_end=4.0),
        dict(rank=1, t_start=1.0, t_end=2.0),
    ]
    assert bubble(ev) == {0: 0.5, 1: 0.75}  # the span is 0..4 for both
    assert theory("1f1b", 4, 8) == theory("gpipe", 4, 8) == 3 / 11
    assert theory("interleaved", 4, 8, 2) == 3 / 19


def test_the_docs_timelines_exist():
    import re

    doc = (ROOT / "docs" / "parallelism.md").read_text()
    pictures = re.findall(r"!\[[^\]]*\]\((img/pipeline_\w+\.png)\)", doc)
    assert {p.split("_")[1] for p in pictures} == {"gpipe", "1f1b", "interleaved"}
    for p in pictures:
        w, h = _png_size((ROOT / "docs" / p).read_bytes())
        assert w > 400 and h > 100
