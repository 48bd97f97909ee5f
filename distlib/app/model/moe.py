"""A sparse mixture of experts (Mixtral's ``block_sparse_moe``) and its load-balancing loss.

``MoE`` takes the place of a block's MLP. On the tokens of x, flattened to (tokens, dim):

    route      router logits = gate(x) (a Linear, no bias); the family's router (``routers``)
               chooses each token's top_k experts and their weights: Mixtral's, probabilities =
               their softmax in float32, the top_k by probability, those k renormalised to sum to 1
               (``model.norm_topk_prob=false``, Qwen3-MoE's option: the probabilities themselves);
               DeepSeek-V3's, sigmoid scores chosen in groups (``routers.SigmoidGroupTopK``)
    dispatch   the (token, slot) pairs grouped by expert, in expert order (a stable sort of the
               flattened expert ids), and each expert's count: ``Dispatch``
    experts    expert e is a SwiGLU MLP, w2(silu(w1 x) * w3 x), no biases, run on its tokens only
               (on zero rows when it has none: its weights still get a gradient, of zeros)
    combine    each expert output times its routing weight (float32, then the activations' dtype),
               added into its token's row, experts in ascending order, starting from zeros

Dropless: every token reaches its k experts whatever the load (no capacity factor, nothing
dropped). That is transformers' ``MixtralSparseMoeBlock`` (router jitter 0) operation for
operation, but for its fused w1|w3 matmul (tests/test_mixtral.py: within 1e-5). Under tensor
parallelism each expert splits by hidden units and the router is replicated (mixtral's plan).

Where the experts run is the layer's ``placement``, chosen once: ``ExpertsHere`` (every expert on
this rank) or, with expert parallelism (``hold_experts_``: the expert group's rank keeps its
n_experts / ep experts, under their own names ``experts.<e>.w1`` ...), ``ExpertsOverRanks``:
``route`` and ``combine`` stay on the token's rank;
``dispatch`` sorts the rows by expert, which cuts them by destination rank too;
``expert_parallel.run_experts`` takes them to their experts' ranks and brings the outputs back in
the order they left, so each token's sum is taken on its own rank in the one-rank order
(tests/test_expert_parallel.py: ep 2 and 4 within 1e-5 of one rank over 20 steps, the tokens per
expert identical).

Each forward records ``last_counts``, the tokens sent to each expert, (n_experts,) int64 on the
device, and ``last_routing``, the router probabilities and counts that ``balance`` reads.

``balance``: the load-balancing loss (Switch Transformer's) as transformers'
``load_balancing_loss_func`` computes it, over every block's rows together: n_experts x
sum_e f_e x P_e, f_e the fraction of the (token, slot) assignments that went to expert e (counts
summed over the blocks, divided by the rows) and P_e the mean router probability of expert e. f
carries no gradient; it is counted over the tokens of the whole batch group (one all-reduce of
the counts over dp x cp per forward), and each rank's term uses its own tokens' P: the ranks'
terms average to the loss of the batch they share, and so do their gradients. Every layout then
trains what one rank would on the whole micro-batch (tests/test_mixtral.py: world size 2 within
1e-5 of world size 1).

``StepBalance``: the same loss over a step of several micro-batches or pipeline stages, whose
counts one forward cannot see (``routing_count`` counts them first). Each block's share of it,
n_experts x sum_e f_e x (its probability sums / the rank's rows of every block), enters the
backward at the block's output (``charge``): the shares of every block and micro-batch add up to
the whole batch's loss, whichever stage holds the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import expert_loads, routers
from distlib.app.model.recompute import is_recomputing
from distlib.comm import collectives
from distlib.comm.group import Comm
from distlib.parallel import expert_parallel
from distlib.parallel.sequence_parallel import SequenceSplit
from distlib.parallel.tensor_parallel import REPLICATED, Replicated

EXPERTS_AT = ".mlp.experts."  # an expert parameter's name: blocks.<b>.mlp.experts.<e>.<w>.weight


def expert_of(name: str) -> int | None:
    """The expert a parameter belongs to, or None for a dense one."""
    if EXPERTS_AT not in name:
        return None
    return int(name.split(EXPERTS_AT)[1].split(".")[0])


class Expert(nn.Module):
    """One expert: Mixtral's SwiGLU MLP (w1: gate, w3: up, w2: down)."""

    PARAMETER_USE = ("w1", "w3", "w2")  # the forward's order (ZeRO's memory prediction reads it)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.mlp_width, bias=False)
        self.w2 = nn.Linear(cfg.mlp_width, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.mlp_width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass(frozen=True)
class Dispatch:
    """The (token, slot) pairs of a routing grouped by expert: expert e's are entries
    [sum(counts[:e]), sum(counts[:e+1])) of ``token`` and ``slot``."""

    token: torch.Tensor  # (tokens x top_k,) int64, expert by expert, tokens ascending within one
    slot: torch.Tensor  # which of the token's top_k choices each pair is (its weight's column)
    counts: list[int]  # pairs per expert

    def rows(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = sum(self.counts[:e])
        end = start + self.counts[e]
        return self.token[start:end], self.slot[start:end]


class MoE(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        sequence: Replicated | SequenceSplit = REPLICATED,
        loads: expert_loads.Loads = expert_loads.READ,
    ):
        super().__init__()
        self.sequence = sequence  # dist.sp: the block hands the tokens gathered; see forward
        self.loads = loads  # the experts' rows: read from the device, or (the planner's) balanced
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.router = routers.for_model(cfg)
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.n_experts))
        # where the experts run: every one here, or (``hold_experts_``) over the expert group's ranks
        self.placement: ExpertsHere | ExpertsOverRanks = ExpertsHere(loads)
        self.last_counts: torch.Tensor | None = None
        self.last_dropped: torch.Tensor | None = None  # with a capacity: assignments dropped, () int64
        self.last_routing: tuple[torch.Tensor, torch.Tensor] | None = None
        self.step_balance: StepBalance | None = None  # the step's counts, when counted first
        self.tally: list | None = None  # while they are counted: (rows, counts, prob sums, dropped)
        # model.balance=bias: the experts' selection biases (state a checkpoint keeps, not trained)
        # and this step's training assignments per expert (``bias_balance``)
        biased = cfg.balance == "bias"
        self.register_buffer("score_bias", torch.zeros(cfg.n_experts) if biased else None, persistent=False)
        counts = torch.zeros(cfg.n_experts, dtype=torch.int64) if biased else None
        self.register_buffer("step_counts", counts, persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert ids (tokens, k) int64, routing weights (tokens, k) float32, router probabilities
        (tokens, n_experts) float32: what the balance loss reads) of x (tokens, dim)."""
        routed = self.router.route(self.router.logits(self.gate, x), self.score_bias)
        return routed.ids, routed.weights, routed.probs

    def dispatch(self, ids: torch.Tensor, counts: list[int]) -> Dispatch:
        # A stable sort keeps each expert's pairs in token order.
        order = torch.argsort(ids.flatten(), stable=True)
        return Dispatch(order // self.top_k, order % self.top_k, counts)

    def combine(self, out: torch.Tensor, token, slot, weights, y: torch.Tensor) -> None:
        """Add expert output ``y`` (rows of ``token``), weighted, into ``out`` (in place)."""
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (batch, seq, dim) or (tokens, dim). With ``dist.sp`` x is the block's gathered tokens:
        every tensor-parallel rank routes all of them (``replicated_in``), each expert's rows are
        all-reduced (``Row(routed=True)``), and the combined output is cut to the rank's tokens
        (``replicated_out``)."""
        flat = x.reshape(-1, x.shape[-1])
        ids, weights, probs = self.route(self.sequence.replicated_in(flat))
        # (one_hot, not bincount: deterministic on every device)
        counts = F.one_hot(ids, self.n_experts).sum(dim=(0, 1))
        self.last_counts, self.last_routing = counts, (probs, counts)
        groups = x.shape[0] if x.dim() == 3 else 1
        if self.capacity_factor is not None:  # dropped assignments go to no expert (the sentinel id)
            kept = self.within_capacity(ids, groups)
            self.last_dropped = (~kept).sum()
            ids = torch.where(kept, ids, self.n_experts)
            counts = F.one_hot(ids, self.n_experts + 1).sum(dim=(0, 1))[: self.n_experts]
        if self.tally is not None:
            self.tally.append((flat.shape[0], self.last_counts, probs.sum(dim=0), self.last_dropped))
        if self.score_bias is not None and self.training and torch.is_grad_enabled() and not is_recomputing():
            self.step_counts += self.last_counts
        out = torch.zeros_like(flat)
        self.placement.run(self, flat, ids, counts, weights, out, self.routed(ids, groups))
        if self.step_balance is not None and torch.is_grad_enabled():
            out = self.step_balance.charge(out, probs)
        return self.sequence.replicated_out(out.view(x.shape))

    def routed(self, ids: torch.Tensor, groups: int) -> expert_loads.Routed:
        """What the router chose from (``expert_loads.Routed``): no expert takes a token twice, nor
        under a capacity more than its capacity from each of the ``groups`` samples."""
        tokens, k = ids.shape
        most = tokens
        if self.capacity_factor is not None:
            most = min(tokens, groups * self.capacity(tokens // groups, k))
        return expert_loads.Routed(tokens, k, most)

    def capacity(self, per: int, k: int) -> int:
        """The most of one sample's assignments (``per`` tokens, ``k`` each) an expert keeps."""
        return math.ceil(self.capacity_factor * per * k / self.n_experts)

    def within_capacity(self, ids: torch.Tensor, groups: int) -> torch.Tensor:
        """(tokens, top_k) bool: the assignments that fit their expert's capacity, GShard's way.
        A group is one sample's sequence: each expert takes at most ceil(capacity_factor x tokens
        x top_k / n_experts) of a sample's assignments, first choices first (in token order), then
        second choices, and so on. Whether an assignment is dropped depends on its sample alone,
        so every layout that keeps samples whole drops the same ones."""
        tokens, k = ids.shape
        per = tokens // groups
        capacity = self.capacity(per, k)
        hot = F.one_hot(ids.view(groups, per, k).transpose(1, 2), self.n_experts)  # (groups, k, per, E)
        queue = hot.reshape(groups, k * per, self.n_experts)  # priority order: slot, then token
        place = (queue.cumsum(dim=1) * queue).sum(dim=-1)  # 1-based place in its expert's queue
        return (place <= capacity).view(groups, k, per).transpose(1, 2).reshape(tokens, k)

    def hold_experts_(self, ep: Comm) -> None:
        """Keep only this rank's experts of the expert group ``ep`` (``expert_parallel``)."""
        self.experts = expert_parallel.keep_held_experts_(self.experts, ep)
        self.placement = ExpertsOverRanks(ep, self.loads)


class ExpertsHere:
    """Every expert of the layer on this rank: each runs its dispatched rows here."""

    def __init__(self, loads: expert_loads.Loads):
        self.loads = loads

    def run(self, moe: MoE, flat, ids, counts, weights, out: torch.Tensor, routed) -> None:
        # One read of the counts (a device sync, as transformers' own loop takes) gives every
        # expert's share.
        plan = moe.dispatch(ids, self.loads.here(counts, routed))
        for e, expert in enumerate(moe.experts):
            # An expert without tokens runs on zero rows all the same: its weights get a (zero)
            # gradient on every rank, as ZeRO's gradient buckets (one per block at stage 3) wait for.
            token, slot = plan.rows(e)
            moe.combine(out, token, slot, weights, expert(flat[token]))


class ExpertsOverRanks:
    """Expert parallelism: this rank holds its share of the experts (``hold_experts_``); the
    dispatched rows go through the experts' ranks of ``ep`` and back (``expert_parallel.run_experts``),
    combined here in the one-rank order."""

    def __init__(self, ep: Comm, loads: expert_loads.Loads):
        self.ep, self.loads = ep, loads

    def run(self, moe: MoE, flat, ids, counts, weights, out: torch.Tensor, routed) -> None:
        routing = self.loads.over(counts, routed, self.ep)  # the one read of the device
        plan = moe.dispatch(ids, routing.counts[self.ep.rank])
        held = {int(e): expert for e, expert in moe.experts.items()}
        sent = plan.token[: sum(plan.counts)]  # (dropped assignments sort last, to no expert)
        y = expert_parallel.run_experts(flat[sent], routing, held, self.ep)
        start = 0
        for e in range(moe.n_experts):
            token, slot = plan.rows(e)
            moe.combine(out, token, slot, weights, y[start : start + len(token)])
            start += len(token)


@dataclass(frozen=True)
class Balance:
    loss: torch.Tensor  # this rank's term, with gradient: the ranks' mean is the batch's loss
    value: torch.Tensor  # the batch's loss, float64, no gradient, the same on every rank
    counts: torch.Tensor  # (blocks, n_experts) float64: tokens per expert over the batch group
    dropped: torch.Tensor | None = None  # (blocks,) float64: assignments over capacity, batch group


def balance(
    routings: list[tuple[torch.Tensor, torch.Tensor]],
    n_experts: int,
    batch: Comm | None,
    dropped: list[torch.Tensor] | None = None,
) -> Balance:
    """The load-balancing loss of one forward from each block's ``last_routing``; ``batch``: the
    ranks whose tokens it counts together (None: this rank's alone). ``dropped``: with a capacity,
    each block's ``last_dropped``, summed over ``batch`` in the same all-reduce."""
    blocks = len(routings)
    prob_sums = torch.stack([probs.sum(dim=0) for probs, _ in routings])  # (blocks, E), gradient
    rows = sum(probs.shape[0] for probs, _ in routings)
    counts = torch.stack([c for _, c in routings]).double()
    # One all-reduce: the rows, the counts, and (for the logged value only) the probability sums.
    packed = torch.cat([counts.new_tensor([rows]), counts.flatten(), prob_sums.detach().double().flatten()])
    if dropped is not None:
        packed = torch.cat([packed, torch.stack(dropped).double()])
    if batch is not None:
        collectives.all_reduce(packed, batch, op="sum")
    counts = packed[1 : 1 + blocks * n_experts].view(blocks, n_experts)
    probs_end = 1 + 2 * blocks * n_experts
    summed = packed[1 + blocks * n_experts : probs_end].view(blocks, n_experts)
    fraction, value = balance_value(counts, summed, packed[0])
    loss = (fraction.float() * (prob_sums.sum(dim=0) / rows)).sum() * n_experts
    return Balance(loss, value, counts, packed[probs_end:] if dropped is not None else None)


def balance_value(
    counts: torch.Tensor, prob_sums: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the summed (blocks, n_experts) routing counts and router probabilities of ``rows``
    rows: f (each expert's fraction of the assignments) and the load-balancing loss's value,
    n_experts x sum(f x mean probability), in float64."""
    fraction = counts.sum(dim=0) / rows
    return fraction, (fraction * prob_sums.sum(dim=0) / rows).sum() * counts.shape[1]


@dataclass(frozen=True)
class StepBalance:
    """A step's load-balancing loss, counted over all of its micro-batches, blocks and batch ranks
    before its forwards (``routing_count``)."""

    fraction: torch.Tensor  # (n_experts,) float32: f, every block's counts over the batch's rows
    blocks: int  # the model's MoE blocks (len(model.moe_layers)), on every stage
    weight: float  # the gradient each share gets: router_aux_loss_coef / the step's micro-batches
    value: float  # the step's loss, as ``balance``'s ``value``

    def charge(self, out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``out`` unchanged, with this block's share of the loss (from ``probs``, its router
        probabilities) entering the backward with ``weight``."""
        rows = self.blocks * probs.shape[0]  # this rank's rows of every block in this micro-batch
        share = (self.fraction * (probs.sum(dim=0) / rows)).sum() * len(self.fraction)
        return _Charge.apply(out, share, self.weight)


class _Charge(torch.autograd.Function):
    """Identity on x; backward also gives ``share`` the gradient ``weight``, as if ``weight x
    share`` had been added to the loss (the loss itself is on another stage, or added as a value)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, share: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None
