"""ZeRO over parameter groups (distlib/parallel/zero/optimizer.py): each group averaged and sharded
over its own ranks, one global norm over every group and kind.

Three proofs on 4 gloo ranks, at every stage: the one optimizer with one group (what a dense run
uses) is its stage optimizer to the bit, clipping included; the model's parameters split into two groups over
the same ranks train bit for bit like one group (same elementwise arithmetic; only the norm's
additions regroup, so without clipping nothing else can differ); and an expert-like layout
(dense parameters over all 4 ranks, an "expert" held by two ranks each, averaged over its
expert-data-parallel pair) equals a single-process reference that holds both experts and applies
the same averaging, clipping by the norm over all four tensors."""

import pytest
import torch
import torch.nn as nn
from multiproc import run_ranks

from distlib.app.config.groups import OptimizerConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.data.batches import BatchPlan, GlobalBatches, make_corpus
from distlib.app.model.minigpt import build_model
from distlib.comm.layout import Layout
from distlib.comm.mesh import build_mesh
from distlib.parallel.adamw import adamw_step_
from distlib.parallel.broadcast import broadcast_module_
from distlib.parallel.zero import ParamGroup, ZeroOptimizer, make_optimizer
from distlib.parallel.zero.stages import stage_optimizer

ODD = ModelConfig(vocab_size=33, seq_len=8, dim=16, n_heads=2, n_layers=2, mlp_ratio=3)
ADAMW = OptimizerConfig(lr=3e-3).adamw


def _values(groups: dict) -> dict[str, torch.Tensor]:
    """Every parameter's value by name, from each optimizer's flat parameters (collective at stage 3)."""
    out = {}
    for opt in groups.values():
        flat = opt.full_params()
        for s in opt.layout.slots:
            out[s.name] = flat[s.offset : s.offset + s.numel].view(s.shape).numpy().copy()  # (tensors do not
            # cross the ranks' result queue)
    return out


def _train_transformer(comm, stage, groups, clip, steps=4):
    """``groups``: 2 (attention and the rest), 1 (``make_optimizer``), 0 (the bare stage optimizer)."""
    model = build_model(ODD, seed=7)
    broadcast_module_(model, comm)
    if groups == 2:
        names = [n for n, _ in model.named_parameters()]
        attn = tuple(n for n in names if ".attn." in n)
        halves = [ParamGroup("attn", attn, comm), ParamGroup("rest", tuple(set(names) - set(attn)), comm)]
        opt = ZeroOptimizer(model, halves, stage, ADAMW, clip)
    elif groups == 1:
        opt = make_optimizer(model, comm, stage, ADAMW, clip)
    else:
        opt = stage_optimizer(model, comm, stage, ADAMW, clip)
    parts = {"all": opt} if groups == 0 else opt.groups
    data = GlobalBatches(
        make_corpus(1, 4096, ODD.vocab_size), ODD.seq_len, BatchPlan(8, comm.size, 1), seed=3
    )
    losses, norms = [], []
    for step in range(steps):
        ((x, y),) = data.micro_batches(step, comm.rank)
        loss = model(x, y)
        loss.backward()
        norms.append(opt.step())
        opt.zero_grad()
        losses.append(float(loss.detach()).hex())
    return losses, norms, opt.param_norm(), _values(parts)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_groups_over_the_same_ranks_train_like_one(stage):
    one = run_ranks(_train_transformer, 4, stage, 1, 0.0)
    two = run_ranks(_train_transformer, 4, stage, 2, 0.0)
    clipped_one = run_ranks(_train_transformer, 4, stage, 1, 0.05)
    clipped_two = run_ranks(_train_transformer, 4, stage, 2, 0.05)
    bare = run_ranks(_train_transformer, 4, stage, 0, 0.05)
    for rank in range(4):
        # one group is its stage optimizer: losses, norms and parameters to the bit, clipping active
        assert clipped_one[rank][:3] == bare[rank][:3], f"stage {stage} rank {rank}: one group differs"
        a, b = clipped_one[rank][3], bare[rank][3]
        assert all(a[n].tobytes() == b[n].tobytes() for n in a) and a.keys() == b.keys()
        assert one[rank][0] == two[rank][0], f"stage {stage} rank {rank}: losses differ"
        a, b = one[rank][3], two[rank][3]
        assert a.keys() == b.keys()
        assert all(a[n].tobytes() == b[n].tobytes() for n in a), (
            f"stage {stage} rank {rank}: parameters differ"
        )
        for x, y in zip(one[rank][1] + [one[rank][2]], two[rank][1] + [two[rank][2]]):
            assert x == pytest.approx(y, rel=1e-6), "the norms over two groups differ from one's"
        # clipping active (norms above 0.05): the coefficient may differ in its last bit only
        assert min(clipped_one[rank][1]) > 0.05
        a, b = clipped_one[rank][3], clipped_two[rank][3]
        assert max(abs(a[n] - b[n]).max() for n in a) < 1e-6


class Toy(nn.Module):
    """A dense layer, one expert (which of two depends on the rank) and a head."""

    def __init__(self):
        super().__init__()
        self.dense, self.expert, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.expert(torch.tanh(self.dense(x))))).pow(2).mean()


def _toys():
    torch.manual_seed(11)
    return Toy(), Toy()  # the second holds expert 1; its dense and head are unused


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _reference(world: int, ep: int, steps: int, clip: float):
    """One process: both experts, every rank's gradient, averaged as the layout does."""
    base, other = _toys()
    params = {n: p.detach().clone() for n, p in base.named_parameters()}
    params |= {f"expert1.{n}": p.detach().clone() for n, p in other.expert.named_parameters()}
    params = {n.replace("expert.", "expert0."): p for n, p in params.items()}
    state = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in params.items()}
    norms = []
    for step in range(steps):
        grads = {n: torch.zeros_like(p) for n, p in params.items()}
        for rank in range(world):
            e = rank % ep  # this rank's place in its expert group (the batch group is the world)
            model = Toy()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(params[n.replace("expert.", f"expert{e}.")])
            model(_batch(rank, step)).backward()
            for n, p in model.named_parameters():
                share = world if not n.startswith("expert") else world // ep
                grads[n.replace("expert.", f"expert{e}.")] += p.grad / share
        norm = float(torch.stack([g.pow(2).sum() for g in grads.values()]).sum().sqrt())
        norms.append(norm)
        coef = min(clip / (norm + 1e-6), 1.0)
        for n, p in params.items():
            adamw_step_(p, grads[n] * coef, *state[n], step + 1, ADAMW)
    return params, norms


def _train_toy(comm, stage, steps, clip, differs):
    mesh = build_mesh(comm, Layout.of(comm.size, ep=2))
    base, other = _toys()
    model = base if mesh.ep.rank == 0 else other
    if mesh.ep.rank == 1:
        model.dense.load_state_dict(base.dense.state_dict())
        model.head.load_state_dict(base.head.state_dict())
    names = [n for n, _ in model.named_parameters()]
    experts = tuple(n for n in names if n.startswith("expert."))
    groups = [
        ParamGroup("dense", tuple(n for n in names if n not in experts), mesh.batch),
        ParamGroup("experts", experts, mesh.expert_dp, (mesh.ep,) if differs else ()),
    ]
    opt = ZeroOptimizer(model, groups, stage, ADAMW, clip)
    norms = []
    for step in range(steps):
        model(_batch(comm.rank, step)).backward()
        norms.append(opt.step())
        opt.zero_grad()
    values = {n.replace("expert.", f"expert{mesh.ep.rank}."): v for n, v in _values(opt.groups).items()}
    return mesh.ep.ranks, mesh.edp.ranks, norms, values


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_experts_averaged_over_their_own_ranks_equal_one_process(stage):
    steps, clip = 3, 0.05
    ref, ref_norms = _reference(4, 2, steps, clip)
    assert min(ref_norms) > clip, "the test needs clipping active"
    results = run_ranks(_train_toy, 4, stage, steps, clip, True)
    for rank, (ep_ranks, edp_ranks, norms, values) in enumerate(results):
        assert ep_ranks == (rank - rank % 2, rank - rank % 2 + 1) and edp_ranks == (rank % 2, rank % 2 + 2)
        assert norms == pytest.approx(ref_norms, rel=1e-6)
        for n, v in values.items():
            assert torch.allclose(torch.from_numpy(v), ref[n], rtol=0, atol=1e-6), (
                f"stage {stage} rank {rank}: {n}"
            )


def test_an_expert_counted_once_gives_another_norm():
    """The expert kind is what makes the norm global: without it each rank counts only its expert."""
    ref_norms = _reference(4, 2, 1, 0.05)[1]
    norms = run_ranks(_train_toy, 4, 1, 1, 0.05, False)[0][2]
    assert norms[0] < ref_norms[0] * (1 - 1e-3)


def test_groups_must_partition_the_parameters():
    model = Toy()
    names = [n for n, _ in model.named_parameters()]
    comm = None  # never reached: the partition is checked first
    with pytest.raises(ValueError, match="missing \\['head.weight'"):
        ZeroOptimizer(model, [ParamGroup("a", tuple(names[:4]), comm)], 1, ADAMW)
    with pytest.raises(ValueError, match="'dense.bias' is in parameter groups 'a' and 'b'"):
        ZeroOptimizer(
            model, [ParamGroup("a", tuple(names), comm), ParamGroup("b", ("dense.bias",), comm)], 1, ADAMW
        )
