"""The planner's dry step, composed (distlib/app/plan/activations.py), against the whole step
program it stands for: the activation peak of every rank and every pipeline stage's FLOPs,
operators, written bytes and calls, equal -- not close -- on layouts of every family (those with
experts at balanced loads), every schedule and dimension, activation checkpointing, bf16, and
micro-batches of 1 to 16 rows.

The reference here runs what the planner ran before it composed: the trainer's step program
(``LocalStep`` or ``PipelineStep`` over the stage's chunks and the real schedule) once over all
``train.grad_accum`` micro-batches, on the meta device, with a counter that has no shape memory
(``OpCounter``'s ``memory``) and the CPU's kernels as a mode of their own. The planner instead
runs one micro-batch of one or two blocks with one, two or three rows and extends them; where a
block, a row or a micro-batch were not alike, the two would differ here.
"""

from __future__ import annotations

import random

import pytest
import torch

from distlib.app.config.model_group import FAMILIES
from distlib.app.config.run import RunConfig
from distlib.app.data.batches import BatchPlan
from distlib.app.model import expert_loads
from distlib.app.model.attention import causal_mask
from distlib.app.model.local_step import LocalStep
from distlib.app.model.pipeline_step import PipelineStep
from distlib.app.model.placement import place_model_, shape_model
from distlib.app.model.routing_count import RoutingCount
from distlib.app.optimizer import param_groups_
from distlib.app.plan import candidates, dry_inputs, units
from distlib.app.plan.activations import memory_loads, rank_activations, stage_counts
from distlib.app.plan.timing import Counted, OpCounter, grouped
from distlib.comm import tally
from distlib.comm.mesh import shape_mesh
from distlib.launch.hydra_config import compose_tree


def whole_step(cfg: RunConfig, stage: int, loads=expert_loads.BALANCED) -> tuple[int, Counted]:
    """Pipeline stage ``stage``'s first rank: its whole step program on the meta device, the
    experts' ``loads`` balanced or the hottest."""
    mesh = shape_mesh(cfg.layout, cfg.layout.rank(pp=stage))
    module = shape_model(cfg, mesh, loads).to("meta")
    chunks, _ = place_model_(module, cfg, mesh)
    param_groups_(module, mesh)  # (as the run's optimizer builds its groups: the rank's experts kept)
    for p in module.parameters():
        p.data = torch.empty(p.shape, dtype=cfg.param_dtype, device="meta")
    micro = BatchPlan(cfg.global_batch, cfg.dp_size, cfg.train.grad_accum).micro_batch
    batch = dry_inputs.micro_batch(cfg.model.seq_len, micro, mesh, cfg.seed)
    m = cfg.train.grad_accum
    program = PipelineStep(cfg, mesh, module, chunks, "meta") if chunks else LocalStep(module, m, "meta")
    cpu = cfg.param_dtype != torch.float32
    ops = OpCounter()
    # the trainer's routing count first, where the experts' routing is counted
    counter = RoutingCount.for_run(cfg, module, mesh, program, torch.device("meta"))
    with dry_inputs._CpuKernels() if cpu else _nothing(), tally.tallied() as calls, ops:
        counter.count([batch] * m)
        program.run([batch] * m)
    return program.activation_peak, Counted(ops.flops, ops.ops, ops.written, grouped(calls))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


LAYOUTS = [
    "model=minigpt dist.world_size=1",
    "model=minigpt dist.world_size=2 dist.pp=2 train.grad_accum=2",
    "model=llama_small dist.world_size=1 train.grad_accum=2",
    "model=llama_small dist.world_size=4 train.grad_accum=4",  # one row a micro-batch
    "model=llama_small dist.world_size=4 dist.pp=4 train.grad_accum=4 dist.pp_schedule=1f1b",
    "model=llama_small dist.world_size=4 dist.pp=2 dist.tp=2 train.grad_accum=4 dist.pp_schedule=interleaved "
    "dist.pp_virtual=2",
    "model=llama_small dist.world_size=4 dist.pp=4 train.grad_accum=8 dist.pp_schedule=gpipe "
    "model.activation_checkpointing=blocks",
    "model=llama_small dist.world_size=2 dist.pp=2 model.activation_checkpointing=blocks train.grad_accum=4",
    "model=gpt2 dist.world_size=4 dist.pp=2 dist.cp=2 train.grad_accum=2 train.dtype=bf16",
    "model=gpt2_124m dist.world_size=3 dist.pp=3 model.tie_embeddings=false model.seq_len=32 "
    "train.global_batch=6 train.grad_accum=3",
    "model=qwen3_tiny dist.world_size=4 dist.tp=2 dist.sp=true train.grad_accum=2",
    "model=qwen3_tiny dist.world_size=2 dist.cp=2 dist.cp_impl=ring model.activation_checkpointing=blocks",
    # experts (balanced loads, expert_loads.py), where no count of the routing comes first
    "model=mixtral_tiny dist.world_size=4 dist.tp=2 train.dtype=bf16",
    "model=mixtral_tiny dist.world_size=4 dist.ep=2 dist.cp=2",
    "model=qwen3_moe dist.world_size=2 dist.ep=2 model.activation_checkpointing=blocks",
    "model=deepseek_v3_tiny dist.world_size=2 dist.tp=2 model.balance=aux model.n_layers=3",  # unlike blocks
    # their routing counted before the step (the loss's over micro-batches or stages; the biases')
    "model=mixtral_tiny dist.world_size=2 dist.pp=2 train.grad_accum=4",
    "model=qwen3_moe dist.world_size=2 dist.ep=2 train.grad_accum=2 dist.tp=1",
    "model=deepseek_v3_tiny dist.world_size=2 dist.ep=2",
    # ... and over micro-batches, where the count's once-a-step share is each unit's (``_count_once``):
    # four alike blocks with tensor-parallel calls; the biases' over unlike blocks
    "model=mixtral_tiny dist.world_size=4 dist.tp=2 train.grad_accum=4",
    "model=deepseek_v3_tiny dist.world_size=2 dist.ep=2 train.grad_accum=2 model.n_layers=4",
    # unlike blocks over pipeline stages: stage 0 a dense block and an MoE one, stage 1 two MoE;
    # interleaved, rank 0's chunks a dense block and an MoE one, rank 1's the same
    "model=deepseek_v3_tiny dist.world_size=2 dist.pp=2 train.grad_accum=2 model.n_layers=4",
    "model=deepseek_v3_tiny dist.world_size=4 dist.pp=2 dist.tp=2 dist.pp_schedule=interleaved "
    "dist.pp_virtual=2 model.n_layers=4 model.first_k_dense_replace=2 train.grad_accum=4 model.balance=aux",
    "model=deepseek_v3_tiny dist.world_size=3 dist.pp=3 model.n_layers=6 model.first_k_dense_replace=3 "
    "train.global_batch=6 train.grad_accum=3",
]


def _sampled(words: list[str], count: int, seed: int) -> list[RunConfig]:
    """A seeded sample of the planner's accepted candidates of ``words`` (its own search)."""
    base = compose_tree(words)
    accepted = [cfg for _, cfg in candidates.candidates(base, set()) if isinstance(cfg, RunConfig)]
    return random.Random(seed).sample(accepted, count)


SAMPLED = [
    *_sampled(["model=llama_small", "dist.world_size=4", "train.global_batch=8"], 6, 0),
    *_sampled(["model=gpt2", "dist.world_size=4"], 4, 1),
]


def _check(cfg: RunConfig) -> None:
    wanted = [whole_step(cfg, s) for s in range(cfg.dist.pp)]
    # the bytes with the loads they are predicted with (over expert-parallel ranks the hottest)
    loads = memory_loads(cfg)
    kept = wanted
    if loads is not expert_loads.BALANCED:
        kept = [whole_step(cfg, s, loads) for s in range(cfg.dist.pp)]
    per_rank = [kept[cfg.layout.coords(r)["pp"]][0] for r in range(cfg.dist.world_size)]
    assert rank_activations(cfg) == per_rank
    counts = stage_counts(cfg)
    assert counts is not None
    for (_, want), got in zip(wanted, counts or ()):
        assert (got.flops, got.ops, got.written) == (want.flops, want.ops, want.written)
        assert sorted(got.calls) == sorted(want.calls)


def test_every_family_is_composed_here():
    """The composition rests on a family's blocks being alike: a family added is checked here."""
    chosen = {RunConfig.from_dict(compose_tree(words.split())).model.family for words in LAYOUTS}
    assert chosen == set(FAMILIES)


@pytest.mark.parametrize("words", LAYOUTS)
def test_the_composed_step_is_the_whole_step_program(words):
    _check(RunConfig.from_dict(compose_tree(words.split())))


@pytest.mark.parametrize("index", range(len(SAMPLED)))
def test_the_composed_step_is_the_whole_step_program_on_sampled_candidates(index):
    _check(SAMPLED[index])


@pytest.mark.parametrize(
    "words",
    [["model=llama", "dist.world_size=4"], ["model=gpt2", "dist.world_size=6", "train.global_batch=12"]],
)
def test_each_candidate_is_checked_as_its_whole_tree_would_be(words):
    """``candidates`` checks a variant from the base's parsed groups (``RunConfig.with_keys``):
    the same configuration, or the same refusal, as the whole tree with the keys set."""
    base = compose_tree(words)
    for changed, got in candidates.candidates(base, set()):
        try:
            want = RunConfig.from_dict(candidates.applied(base, changed))
        except Exception as exc:  # noqa: BLE001 - compared by message
            want = exc
        if isinstance(want, Exception):
            assert str(got) == str(want), changed
        else:
            assert got == want, changed


def test_every_block_reads_one_causal_mask():
    cfg = RunConfig.from_dict(compose_tree(["model=llama_small", "dist.world_size=1"]))
    model = shape_model(cfg, shape_mesh(cfg.layout, 0))
    masks = {
        id(buf) for name, buf in model.named_buffers(remove_duplicate=False) if name.endswith("causal_mask")
    }
    seq = cfg.model.seq_len
    assert len(masks) == 1 and torch.equal(causal_mask(seq), torch.ones(seq, seq, dtype=torch.bool).tril())


def test_the_shape_memory_answers_new_tensors_alike_and_never_a_view():
    """``MetaMemo``: a second identical call is answered from memory with the kernel's shape,
    strides, dtype and storage size; a view (said by its schema or not) and an in-place result are
    the kernel's own, sharing their input's storage; a CPU tensor is computed."""
    from distlib.app.plan import meta_memo

    x = torch.empty((4, 6), device="meta").t()  # strided (1, 4): the answer keeps the strides
    y = torch.empty((4, 6), device="meta")
    with meta_memo.MetaMemo():
        first, again = torch.ops.aten.mul.Tensor(x, 2.0), torch.ops.aten.mul.Tensor(x, 2.0)
        made = torch.ops.aten.mul.Tensor(y, 3.0)
        unsafe = [torch.ops.aten._unsafe_view(made, (24,)) for _ in range(2)]  # the second: seen
        views = [*unsafe, made.view(24), made.view(24), made.t()]
        grown = made.add_(1.0)
        cpu = torch.ops.aten.mul.Tensor(torch.ones(3), 2.0)
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata
    described = [
        (t.shape, t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes())
        for t in (first, again)
    ]
    assert described[0] == described[1] and first.stride() == x.stride()
    assert all(v.untyped_storage()._cdata == made.untyped_storage()._cdata for v in views) and grown is made
    assert torch.equal(cpu, torch.full((3,), 2.0))


@pytest.mark.parametrize(
    "words, where",
    [
        # the routing counted first (its balance set on the blocks); the CPU's bf16 kernels
        ("model=qwen3_moe dist.world_size=2 dist.ep=2 train.grad_accum=2", "only"),
        ("model=mixtral_tiny dist.world_size=2 dist.tp=2 train.dtype=bf16", "only"),
        ("model=llama_small dist.world_size=2 model.activation_checkpointing=blocks", "last"),
    ],
)
def test_a_unit_runs_alike_on_a_shared_build_and_a_fresh_one(words, where):
    """``units.run`` builds a unit's model once for every micro-batch size: each run after the
    first, on the build the one before used, is a run on a fresh build, to the byte and call."""
    rank = units.Rank.of(RunConfig.from_dict(compose_tree(words.split())))
    units._built.cache_clear()
    shared = [units.run.__wrapped__(rank, micro, 1, where) for micro in (3, 2, 1)]
    fresh = []
    for micro in (3, 2, 1):
        units._built.cache_clear()
        fresh.append(units.run.__wrapped__(rank, micro, 1, where))
    assert shared == fresh


@pytest.mark.parametrize(
    "words",
    ["model=mixtral_tiny dist.world_size=2 dist.ep=2", "model=deepseek_v3_tiny dist.world_size=2 dist.ep=2"],
)
def test_a_bytes_only_unit_keeps_what_a_timed_one_does(words):
    """A unit of bytes alone (the experts' hottest loads) runs its forward without the backward:
    what it keeps for the backward, and its gradient bytes, are the timed unit's."""
    cfg = RunConfig.from_dict(compose_tree(words.split()))
    timed, kept = (units.Rank.of(cfg, expert_loads.HOTTEST, timed=t) for t in (True, False))
    for micro in (1, 3):
        full = units.run.__wrapped__(timed, micro, 2, "only")
        alone = units.run.__wrapped__(kept, micro, 2, "only")
        assert (alone[0], alone[2]) == (full[0], full[2]) and alone[1].ops < full[1].ops
