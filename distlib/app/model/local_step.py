"""The forward/backward of one training step at ``dist.pp`` = 1: every micro-batch through the whole
model, in order. The step program's other form is ``pipeline_step.PipelineStep`` (``dist.pp`` > 1);
the trainer composes one of them, and both give ``run(batches)`` (this rank's summed loss, float64
on the device), ``forward_only(batches)`` (the routing count's forwards) and ``activation_peak``.
"""

from __future__ import annotations

import torch

from distlib.app.model.layers import CausalLM
from distlib.app.observe.activations import ActivationMeter


class LocalStep:
    def __init__(self, model: CausalLM, grad_accum: int, device):
        self.model, self.grad_accum, self.device = model, grad_accum, torch.device(device)
        self.activations = ActivationMeter()  # bytes kept for backward (the memory profile's activations)

    def run(self, batches) -> torch.Tensor:
        """Forward and backward over ``batches`` ((inputs, targets, positions, draws, documents) each); each
        micro-batch's loss divided by ``train.grad_accum`` before its backward."""
        self.model.train()
        # Summed in float64 on the device, read once: the same additions, in the same order, as adding
        # each micro-batch's float(loss) on the host, without a device sync per micro-batch.
        local_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, targets, positions, draws, documents in batches:
            with self.activations.measure(self.model):
                loss = self.model(inputs, targets, positions, draws, documents) / self.grad_accum
            loss.backward()
            local_loss += loss.detach()
        return local_loss

    def kept(self, batches) -> None:
        """The micro-batches' forwards as ``run`` measures them, without their backwards: what a
        step keeps for its backward (``activation_peak``) and nothing more (the planner's bytes)."""
        self.model.train()
        for inputs, targets, positions, draws, documents in batches:
            with self.activations.measure(self.model):
                # (held until the meter reads it: a dropped loss frees its graph's saved tensors)
                loss = self.model(inputs, targets, positions, draws, documents)
            del loss

    def forward_only(self, batches) -> None:
        """The micro-batches' forwards, without targets (call under ``torch.no_grad``)."""
        for inputs, _, positions, draws, documents in batches:
            self.model(inputs, None, positions, draws, documents)

    @property
    def activation_peak(self) -> int:
        """The most bytes autograd kept from one forward for its backward, over the run's steps."""
        return self.activations.peak
