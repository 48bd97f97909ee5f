"""``metrics.tensorboard``: rank 0's step records also as TensorBoard scalars (<run dir>/tensorboard/).

The JSONL log stays the source of truth: every scalar here is a field of the step record that was
just written to the metrics file, under its path in that record as the tag (``loss``,
``memory/peak_rss_bytes/max``), at the record's step and wall time. TensorBoard keeps a scalar as
a float32, so a value reads back as the record's value rounded to float32. A re-run step (after
a rollback) is written again at the same step, as it is appended to the JSONL file again.

``torch.utils.tensorboard`` is imported only when the option is on: it brings tensorboard and
protobuf (about 0.3 s), not ``torch._dynamo``. Its writer keeps a background thread until
``close``.
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = "tensorboard"
# the step record's fields that become scalars (memory: each key's max and mean over ranks)
FIELDS = ("loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "mfu", "val_loss")


def scalars(record: dict) -> list[tuple[str, float]]:
    """(tag, value) of a step record's scalars; a field the record lacks or holds as null (no
    validation at this step, no tokens/s for a zero step time) is left out."""
    out = [(name, float(record[name])) for name in FIELDS if record.get(name) is not None]
    for key, stats in record["memory"].items():
        out += [(f"memory/{key}/{stat}", float(stats[stat])) for stat in ("max", "mean")]
    return out


class TensorBoardLog:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / DIRECTORY))

    def write(self, record: dict) -> None:
        """The step record's scalars, flushed at once like the JSONL line."""
        for tag, value in scalars(record):
            self.writer.add_scalar(tag, value, global_step=record["step"], walltime=record["time"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
