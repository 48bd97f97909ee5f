"""What the Hugging Face conversions share: their one error, the optional import of transformers,
the refusal of what would not convert exactly, and the rotary settings every rotary family reads."""

from __future__ import annotations

MISSING_EXTRA = "this needs the optional `hf` extra (transformers): pip install -e '.[hf]'"


class HFError(ValueError):
    """A config or checkpoint that cannot be converted exactly, with the one-line reason."""


def transformers_module():
    try:
        import transformers
    except ImportError as exc:
        raise HFError(MISSING_EXTRA) from exc
    return transformers


def refuse_if(condition: bool, reason: str) -> None:
    if condition:
        raise HFError(f"cannot convert exactly: {reason}")


def rope_theta(c, raw: dict) -> float:
    """The RoPE base of transformers' config ``c`` (read from config.json ``raw``), refusing any
    scaling: only default RoPE is implemented."""
    scaling = raw.get("rope_scaling")
    refuse_if(scaling is not None, f"rope_scaling={scaling!r} (only default RoPE, no scaling)")
    rope = dict(c.rope_parameters or {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)})
    refuse_if(
        rope.get("rope_type", "default") != "default" or bool(set(rope) - {"rope_type", "rope_theta"}),
        f"rope_parameters={rope!r} (only default RoPE, no scaling)",
    )
    return float(rope.get("rope_theta", 10000.0))
