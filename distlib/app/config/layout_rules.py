"""The rules of the newer parallel dimensions (context, sequence and expert parallelism) that span
config groups, each one ConfigError naming the keys; ``cfg`` is a ``run.RunConfig``, whose
``from_dict`` runs them."""

from __future__ import annotations

from distlib.app.config.schema import ConfigError


def check_context(cfg) -> None:
    d, m = cfg.dist, cfg.model
    if d.cp == 1:
        return
    if m.seq_len % (2 * d.cp):
        raise ConfigError(
            f"model.seq_len={m.seq_len} must be divisible by 2 x dist.cp = {2 * d.cp} (each context-parallel "
            f"rank holds two equal chunks)"
        )
    heads = m.n_heads // d.tp
    if d.cp_impl == "alltoall" and heads % d.cp:
        raise ConfigError(
            f"dist.cp_impl=alltoall needs the heads per tensor-parallel rank, model.n_heads/dist.tp = "
            f"{m.n_heads}/{d.tp} = {heads}, divisible by dist.cp={d.cp}; use dist.cp_impl=ring"
        )
    if d.cp_impl == "ring" and m.dropout > 0:
        raise ConfigError(
            f"model.dropout={m.dropout} is not supported with dist.cp_impl=ring (the ring computes attention "
            f"blocks itself, without dropout); use dist.cp_impl=alltoall or model.dropout=0"
        )
    if cfg.train.eval_every:
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every} is not supported with dist.cp={d.cp} (the held-out "
            f"loss runs whole sequences)"
        )
    if m.capacity_factor is not None:
        raise ConfigError(
            f"model.capacity_factor={m.capacity_factor} is not supported with dist.cp={d.cp} (an expert's "
            f"capacity counts a whole sequence's tokens); set model.capacity_factor=null"
        )


def check_sequence(cfg) -> None:
    d, seq = cfg.dist, cfg.model.seq_len
    if not d.sp:
        return
    if d.tp == 1:
        raise ConfigError("dist.sp=true needs dist.tp > 1 (it splits the sequence over the tp ranks)")
    if seq % d.tp:
        raise ConfigError(
            f"model.seq_len={seq} must be divisible by dist.tp={d.tp} with dist.sp=true (each "
            f"tensor-parallel rank holds seq_len/tp tokens)"
        )
    for name, value in [("dist.pp", d.pp), ("dist.cp", d.cp)]:
        if value > 1:
            raise ConfigError(f"dist.sp=true is not supported with {name}={value} yet; set dist.sp=false")
    if cfg.model.family == "mixtral":  # split_sequence_ would make each expert's w2 reduce-scatter its tokens
        raise ConfigError("dist.sp=true is not supported with model.family=mixtral yet; set dist.sp=false")


def check_experts(cfg) -> None:
    d, m = cfg.dist, cfg.model
    if d.ep == 1:
        return
    if m.family != "mixtral":
        raise ConfigError(f"dist.ep={d.ep} needs a model with experts (model.family=mixtral), not {m.family}")
    if m.n_experts % d.ep:
        raise ConfigError(
            f"dist.ep={d.ep} must divide model.n_experts={m.n_experts} (each rank of an expert group holds "
            f"n_experts / ep of every block's experts)"
        )
