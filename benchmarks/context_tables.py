"""benchmarks/context.py's tables on stdout (its JSON holds the same numbers)."""

from __future__ import annotations

ONE = "one rank"  # the route name of the cp = 1 rows


def print_tables(model: str, memory, fits, steps_out, a2a, seqs, budget_mib) -> None:
    """The activation, step-time and all-to-all tables (``model``: what the first one is of)."""
    mib = {(m["cp"], m["route"], m["seq_len"]): m["activation_bytes"] / 2**20 for m in memory}
    worst = {}
    for m in memory:
        key = (m["cp"], m["route"])
        worst[key] = max(worst.get(key, 0.0), m["loss_rel_vs_cp1"])
    print(f"{model}: activation MiB per rank (largest rank); longest seq in {budget_mib:g} MiB")
    head = f"{'cp':>3} {'route':<9}" + "".join(f"{s:>9}" for s in seqs)
    print(head + f"{'fit err':>9}{'longest':>10}{'+ masks':>9}{'loss vs cp1':>13}")
    for f in fits:
        cp, route = f["cp"], f["route"]
        cells = "".join(f"{mib[cp, route, s]:>9.2f}" for s in seqs)
        print(
            f"{cp:>3} {route:<9}{cells}{f['max_rel_residual']:>9.0e}{f['longest_seq']:>10,}"
            f"{f['longest_seq_with_masks']:>9,}{worst[cp, route]:>13.1e}"
        )
    print("\nforward + backward ms, median (min-max) of the slowest rank")
    print(
        f"{'cp':>3}{'seq':>6}{'1 rank':>9}{'alltoall':>18}{'ring':>18}{'ring speed-up':>15}"
        f"{'CPU ms a2a':>12}{'CPU ms ring':>12}{'torch coll':>12}{'vs torch coll':>15}"
    )
    rows = {(s["cp"], s["route"], s["seq_len"]): s for s in steps_out}
    for cp in sorted({s["cp"] for s in steps_out if s["cp"] > 1}):
        for seq in seqs:
            a, r, t = (rows[cp, k, seq] for k in ("alltoall", "ring", "alltoall torch"))
            cell = lambda s: f"{s['ms']:>8.1f} ({s['ms_min']:.0f}-{s['ms_max']:.0f})"  # noqa: E731
            print(
                f"{cp:>3}{seq:>6}{rows[1, ONE, seq]['ms']:>9.1f}{cell(a):>18}{cell(r):>18}"
                f"{r['ring_speedup']:>15.2f}{a['cpu_ms']:>12.0f}{r['cpu_ms']:>12.0f}"
                f"{t['ms']:>12.1f}{a['ratio_vs_torch_collectives']:>15.2f}"
            )
    print("\nall-to-all, equal pieces: ms (median of the slowest rank); ratio = torch ms / ours")
    print(f"{'world':>5}{'bytes':>8}{'direct':>9}{'pairwise':>10}{'torch':>9}{'direct':>9}{'pairwise':>10}")
    for r in a2a:
        b = r["bytes"]
        size = f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K"
        print(
            f"{r['world']:>5}{size:>8}{r['direct_ms']:>9.3f}{r['pairwise_ms']:>10.3f}{r['torch_ms']:>9.3f}"
            f"{r['ratio_direct']:>9.2f}{r['ratio_pairwise']:>10.2f}"
        )


def print_kv(kv: list[dict], heads: int, kv_heads: int) -> None:
    """The key/value bytes table: a Llama's repeated and grouped, and the latent attention's."""
    print(
        f"\nLlama, {heads} query heads and {kv_heads} key/value head(s): bytes rank 0 sends on "
        f"the cp group per step (forward + backward), K/V repeated to the query heads before they move "
        f"(as before) and grouped (now)"
    )
    print(
        "and DeepSeek-V3's latent attention of the same width and heads (latent: its ring sends the "
        "compressed latent; the all-to-all gathers it, or moves the expanded keys and values where fewer)"
    )
    head = f"{'cp':>3} {'route':<9}{'seq':>6}{'repeated':>11}{'grouped':>11}{'ratio':>7}"
    print(head + f"{'latent':>11}{'ratio':>7}")
    for row in kv:
        print(
            f"{row['cp']:>3} {row['route']:<9}{row['seq_len']:>6}{row['repeated']:>11}{row['grouped']:>11}"
            f"{row['ratio']:>7.3f}{row['latent']:>11}{row['latent_ratio']:>7.3f}"
        )
