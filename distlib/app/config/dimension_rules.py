"""Each parallel dimension's rules against the rest of the config (the model's shapes, the
schedule, the features it cannot serve yet), one ConfigError naming the keys; ``cfg`` is a
``run.RunConfig``, whose ``from_dict`` runs ``check`` once the layout itself is known to hold
(``comm.layout``: degrees and divisibility). One function per dimension: tensor, data (the global
batch over the ranks the world leaves), pipeline, context, sequence (inside tensor) and expert
parallelism, checked in that order."""

from __future__ import annotations

from distlib.app.config.model_group import ROTARY, ModelConfig
from distlib.app.config.schema import ConfigError
from distlib.comm.layout import DIMENSIONS
from distlib.parallel.pipeline.schedule import stage_block_ids


def check(cfg) -> None:
    """Every dimension's rules, in order."""
    check_tensor_parallel(cfg.model, cfg.dist.tp)
    check_batch(cfg)
    check_pipeline(cfg)
    check_context(cfg)
    check_sequence(cfg)
    check_experts(cfg)


def check_tensor_parallel(m: ModelConfig, tp: int) -> None:
    """Every dimension tensor parallelism splits divides by ``tp``: the attention heads, (llama,
    mixtral) the key/value heads, the MLP's (each expert's) hidden units, (deepseek_v3) the dense
    blocks' (``model.families.shard_model_`` checks the same)."""
    splits = [("model.n_heads", m.n_heads, "attention heads")]
    if m.family in ROTARY:
        splits.append(("model.n_kv_heads", m.kv_heads, "key/value heads"))
    width = "model.mlp_hidden" if m.mlp_hidden is not None else "the MLP width model.mlp_ratio x model.dim"
    splits.append((width, m.mlp_width, "MLP hidden units"))
    if m.family == "deepseek_v3" and m.first_k_dense_replace:
        dense = "model.dense_mlp_hidden" if m.dense_mlp_hidden is not None else "model.mlp_ratio x model.dim"
        splits.append((dense, m.dense_width, "the dense blocks' MLP hidden units"))
    for name, value, what in splits:
        if value % tp:
            raise ConfigError(
                f"invalid parallel layout: dist.tp={tp} must divide {name}={value} ({what} are split "
                f"across tensor-parallel ranks)"
            )


def check_batch(cfg) -> None:
    """The data-parallel ranks (what the world leaves) take the global batch in equal micro-batches."""
    t, ranks, d = cfg.train, cfg.dp_size, cfg.dist
    # the data-parallel ranks, as what the world leaves after the grid's dimensions set above 1
    split = [dim for dim in DIMENSIONS if not dim.over and cfg.degree(dim) > 1]
    keys, sizes = [dim.key for dim in split], [str(cfg.degree(dim)) for dim in split]
    if not split:
        where = f"dist.world_size={ranks}"
    elif len(split) == 1:
        where = f"dist.world_size/{keys[0]}={d.world_size}/{sizes[0]}={ranks} data-parallel"
    else:
        where = (
            f"dist.world_size/({' x '.join(keys)})={d.world_size}/({' x '.join(sizes)})={ranks} data-parallel"
        )
    if cfg.global_batch % (ranks * t.grad_accum):
        raise ConfigError(
            f"train.global_batch={cfg.global_batch} does not divide into {where} rank(s) x "
            f"train.grad_accum={t.grad_accum} micro-batch(es); use a multiple of {ranks * t.grad_accum}"
        )
    derived = cfg.global_batch // (ranks * t.grad_accum)
    if t.batch_size is not None and t.batch_size != derived:
        raise ConfigError(
            f"train.batch_size={t.batch_size} contradicts train.global_batch={cfg.global_batch} / "
            f"({where} x train.grad_accum={t.grad_accum}) = {derived}; set only one of them "
            f"(train.global_batch=null to size the batch per rank)"
        )


def check_pipeline(cfg) -> None:
    d = cfg.dist
    if d.pp == 1:
        return
    chunks = d.pp * d.pp_virtual
    if cfg.model.n_layers % chunks:
        raise ConfigError(
            f"model.n_layers={cfg.model.n_layers} does not split into dist.pp x dist.pp_virtual = "
            f"{d.pp} x {d.pp_virtual} = {chunks} equal pipeline chunks"
        )
    if d.pp_schedule == "interleaved" and cfg.train.grad_accum % d.pp:
        raise ConfigError(
            f"dist.pp_schedule=interleaved needs train.grad_accum (micro-batches, "
            f"{cfg.train.grad_accum}) to be a multiple of dist.pp={d.pp}"
        )
    if cfg.model.tie_embeddings:
        raise ConfigError(
            f"model.tie_embeddings=true is not supported with dist.pp={d.pp}: the first stage's embedding "
            f"and the last stage's LM head would be one weight on two ranks; set model.tie_embeddings=false "
            f"or dist.pp=1"
        )
    if cfg.train.eval_every:
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every} is not supported with dist.pp={d.pp} "
            f"(the held-out loss runs the whole model on one rank); set train.eval_every=0"
        )


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


def check_experts(cfg) -> None:
    d, m = cfg.dist, cfg.model
    if d.ep == 1:
        return
    if not m.has_experts:
        raise ConfigError(
            f"dist.ep={d.ep} needs a model with experts (model.family=mixtral, qwen3_moe or deepseek_v3), "
            f"not {m.family}"
        )
    if m.n_experts % d.ep:
        raise ConfigError(
            f"dist.ep={d.ep} must divide model.n_experts={m.n_experts} (each rank of an expert group holds "
            f"n_experts / ep of every block's experts)"
        )
    if d.pp > 1:
        check_experts_on_every_stage(m, d.pp, d.pp_virtual, d.ep)


def check_experts_on_every_stage(m: ModelConfig, pp: int, virtual: int, ep: int) -> None:
    """With experts split over ep, each pipeline rank must hold some MoE block among the blocks its
    chunks run, or its ranks would have no experts to split (a DeepSeek-V3 whose dense blocks fill a
    stage)."""
    for rank in range(pp):
        held = [b for chunk in stage_block_ids(m.n_layers, pp, virtual, rank) for b in chunk]
        if not set(m.moe_layers) & set(held):
            raise ConfigError(
                f"dist.ep={ep} with dist.pp={pp}: pipeline rank {rank} holds blocks {held}, none with "
                f"experts (model.first_k_dense_replace={m.first_k_dense_replace} dense blocks first), "
                f"so it has no experts to split; give every pipeline rank an MoE block (fewer dense "
                f"blocks or pipeline stages) or set dist.ep=1"
            )
