"""scripts/report.py's part for a mixture-of-experts run (``model.family=mixtral``): its step
records carry ``expert_tokens`` (per block, the assignments each expert received in the step over
all ranks) and, with ``model.capacity_factor``, ``dropped_tokens`` (per block).

``text``: per block, the tokens per expert at the last step and the load imbalance over the run
(the busiest expert's tokens over the mean, 1 = balanced: its first, last and largest value), and
the assignments dropped. ``png``: ``experts.png``, a panel per block, a line per expert: its
tokens per step. Needs no torch.
"""

from __future__ import annotations

from pathlib import Path


def _series(steps: list[dict]) -> tuple[list[int], list[list[list[int]]]]:
    """(steps that carry expert_tokens, their expert_tokens [step][block][expert])."""
    kept = [s for s in steps if "expert_tokens" in s]
    return [s["step"] for s in kept], [s["expert_tokens"] for s in kept]


def imbalance(counts: list[int]) -> float:
    """The busiest expert's tokens over the mean (1.0: every expert got the same)."""
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 0.0


def text(steps: list[dict]) -> list[str]:
    numbers, tokens = _series(steps)
    if not tokens:
        return []
    blocks, experts = len(tokens[0]), len(tokens[0][0])
    lines = [f"experts: {blocks} blocks x {experts} experts; tokens per expert at step {numbers[-1]}:"]
    for b in range(blocks):
        load = [imbalance(t[b]) for t in tokens]
        lines.append(
            f"  block {b}: {tokens[-1][b]}  imbalance (max/mean) first {load[0]:.2f}, "
            f"last {load[-1]:.2f}, max {max(load):.2f}"
        )
    dropped = [s["dropped_tokens"] for s in steps if "dropped_tokens" in s]
    if dropped:
        per_block = [sum(d[b] for d in dropped) for b in range(blocks)]
        lines.append(f"  dropped over capacity in {len(dropped)} steps, per block: {per_block}")
    return lines


def png(steps: list[dict], out: Path, plt) -> Path | None:
    numbers, tokens = _series(steps)
    if not tokens:
        return None
    blocks, experts = len(tokens[0]), len(tokens[0][0])
    fig, axes = plt.subplots(blocks, 1, figsize=(8, 2.2 * blocks + 0.6), sharex=True, squeeze=False)
    for b, ax in enumerate(axes[:, 0]):
        for e in range(experts):
            ax.plot(numbers, [t[b][e] for t in tokens], label=f"expert {e}", linewidth=1)
        ax.set_ylabel("tokens")
        ax.set_title(f"block {b}", fontsize=9)
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].legend(fontsize=7, ncol=min(experts, 8), loc="lower center", bbox_to_anchor=(0.5, 1.15))
    fig.suptitle("tokens per expert (all ranks)")
    fig.tight_layout()
    path = out / "experts.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
