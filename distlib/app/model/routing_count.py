"""The load-balancing loss of a whole step when no one forward sees it (mixtral, with
``train.grad_accum`` > 1 or ``dist.pp`` > 1).

Transformers' loss is n_experts x sum_e f_e x P_e over every block's rows of the batch, f_e the
fraction of the assignments that went to expert e. A micro-batch's forward sees only its own
tokens, and a pipeline stage only its own blocks; adding each one's own loss (what transformers'
Trainer does under accumulation) is another loss, and on a pipeline there is none to add. f carries
no gradient, though, and the loss is linear in the probabilities: knowing f before the step's
forwards, each block's rows can charge their share of the gradient where they are
(``moe.StepBalance``). So ``RoutingCount.count`` runs the step's micro-batches forward once
without gradients (on a pipeline, every stage's forwards of the schedule, in its order), each
block tallying its routing; one all-reduce over the batch ranks and one over the stages give every
rank the whole step's counts, and so f and the loss's value. The forward then runs as usual, with
the dropout masks of the counting forward (they are keyed by sample and site,
``distlib.parallel.dropout``; without keys, the RNG is restored after the count). Cost: one more
forward per step, without saving activations.
"""

from __future__ import annotations

import torch

from distlib.app.model import moe
from distlib.app.model.bias_balance import BiasBalance
from distlib.app.model.families import moe_blocks
from distlib.app.model.layers import CausalLM
from distlib.comm import collectives
from distlib.comm.mesh import Mesh


def counted(cfg) -> bool:
    """Whether a run's steps count their routing (``cfg`` a ``RunConfig``): a model with experts
    balanced by its biases, or by the loss over several micro-batches or pipeline stages."""
    model = cfg.model
    several = cfg.train.grad_accum > 1 or cfg.dist.pp > 1
    return model.has_experts and (model.balance == "bias" or several)


class RoutingCount:
    def __init__(self, model: CausalLM, mesh: Mesh, program, grad_accum: int, device: torch.device):
        # program: the step program (local_step.LocalStep or pipeline_step.PipelineStep): its forwards
        self.model, self.mesh, self.program = model, mesh, program
        self.cfg, self.grad_accum, self.device = model.cfg, grad_accum, device

    @classmethod
    def for_run(cls, cfg, model: CausalLM, mesh: Mesh, program, device: torch.device):
        """The counter a run's steps need (``cfg`` a ``RunConfig``): with ``model.balance=bias`` the
        biases' (``bias_balance``: the step's own forwards count); a Mixtral balanced by the loss over
        several micro-batches or pipeline stages counts first; every other run gets ``NOTHING_TO_COUNT``."""
        if not counted(cfg):
            return NOTHING_TO_COUNT
        return cls.counter(model, mesh, program, cfg.train.grad_accum, device)

    @classmethod
    def counter(cls, model: CausalLM, mesh: Mesh, program, grad_accum: int, device: torch.device):
        """The counter of a model whose routing is counted (``counted``): its biases' or the loss's."""
        if model.cfg.balance == "bias":
            return BiasBalance(model, mesh, model.cfg.bias_update_speed)
        return cls(model, mesh, program, grad_accum, device)

    def update(self) -> None:
        """After the step's update: nothing (the loss did the balancing)."""

    def fields(self) -> dict:
        return {}  # (the model's routing log holds the step's record)

    def count(self, batches: list) -> None:
        """Count the routing of the step's ``batches`` ((inputs, targets, positions, draws) each) and set
        every block's ``step_balance`` and the model's, and the step's routing record."""
        blocks = moe_blocks(self.model)
        for _, m in blocks:
            m.tally, m.step_balance = [], None
        self.model.step_balance = None
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            self.program.forward_only(batches)
        packed = self._packed(blocks)
        for group in (self.mesh.batch, self.mesh.pp):
            if group is not None and group.size > 1:
                collectives.all_reduce(packed, group, op="sum")
        self._set(packed, blocks)

    def _parts(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of ``packed`` (after its total rows): counts (L, E), probability sums (L, E),
        dropped (L,)."""
        L, E = len(self.cfg.moe_layers), self.cfg.n_experts
        return packed[1 : 1 + L * E].view(L, E), packed[1 + L * E : -L].view(L, E), packed[-L:]

    def _packed(self, blocks) -> torch.Tensor:
        """[rows, counts, probability sums, dropped] (``_parts``) of this rank's tallies, float64,
        each MoE block at its place in ``model.moe_layers`` (zeros for the blocks of other stages)."""
        L, E = len(self.cfg.moe_layers), self.cfg.n_experts
        packed = torch.zeros(1 + 2 * L * E + L, dtype=torch.float64, device=self.device)
        counts, probs, dropped = self._parts(packed)
        for block, m in blocks:
            i = self.cfg.moe_row(block)
            for rows, c, p, d in m.tally:
                packed[0] += rows
                counts[i] += c
                probs[i] += p.double()
                if d is not None:
                    dropped[i] += d
            m.tally = None
        return packed

    def _set(self, packed: torch.Tensor, blocks) -> None:
        counts, probs, dropped = self._parts(packed)
        fraction, value = moe.balance_value(counts, probs, packed[0])
        value = self.model.loads.value(value)  # (the dry step's model has none to read)
        weight = self.cfg.router_aux_loss_coef / self.grad_accum
        balance = moe.StepBalance(fraction.float(), len(self.cfg.moe_layers), weight, value)
        for _, m in blocks:
            m.step_balance = balance
        self.model.step_balance = balance
        self.model.routing_log.clear()  # the step's one record (step_fields reads the last)
        kept = [packed.new_tensor([value]), counts.flatten()]
        kept += [dropped] if self.cfg.capacity_factor is not None else []
        self.model.routing_log.append(torch.cat(kept))


class NothingToCount:
    """The counter of a run whose forwards see the whole step's routing themselves (or have none)."""

    def count(self, batches: list) -> None:
        pass

    def update(self) -> None:
        pass

    def fields(self) -> dict:
        return {}


NOTHING_TO_COUNT = NothingToCount()
