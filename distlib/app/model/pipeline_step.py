"""The forward/backward of one training step at ``dist.pp`` > 1: this rank's part of a schedule.

``split_model_`` keeps this pipeline rank's chunks of the model (``distlib.app.model.pipeline``);
``PipelineStep.run`` runs this rank's action list of the schedule (``dist.pp_schedule``,
``distlib.parallel.pipeline.schedule``) over this step's micro-batches and returns its summed
loss the way ``Trainer._forward_backward`` does at pp = 1: each micro-batch's loss divided by
``train.grad_accum`` before its backward, added in micro-batch order in float64 -- on the last
stage; the other stages return 0 (the guard's verdict takes the loss from the last stage's ranks,
``Mesh.loss_ranks``). Gradients accumulate in the optimizer's buffers exactly as at pp = 1 (each
stage runs its micro-batches' backwards in micro-batch order), so the step is the same
arithmetic as at pp = 1, spread over ranks.
"""

from __future__ import annotations

import torch

from distlib.app.config.operation import DistConfig
from distlib.app.config.run import RunConfig
from distlib.app.model.layers import CausalLM, lm_loss
from distlib.app.model.pipeline import Chunk, keep_stage_
from distlib.comm.mesh import Mesh
from distlib.parallel.pipeline import executor, schedule
from distlib.parallel.pipeline.recorder import Recorder


def split_model_(model: CausalLM, dist: DistConfig, mesh: Mesh) -> list[Chunk] | None:
    """Keep only this pipeline rank's chunks of ``model`` (None, and nothing changed, at pp = 1)."""
    if dist.pp == 1:
        return None
    return keep_stage_(model, dist.pp, dist.pp_virtual, mesh.pp.rank)


class PipelineStep:
    def __init__(self, cfg: RunConfig, mesh: Mesh, model: CausalLM, chunks: list[Chunk], device):
        dist = cfg.dist
        self.P, self.v, self.m = dist.pp, dist.pp_virtual, cfg.train.grad_accum
        self.mesh, self.model, self.chunks = mesh, model, chunks
        self.dtype, self.device = cfg.param_dtype, torch.device(device)
        self.plan = schedule.build(dist.pp_schedule, self.P, self.m, self.v)
        self.recorder = Recorder(mesh.pp.rank)  # the last step's events and activation bytes
        self.peak = 0

    def run(self, batches) -> torch.Tensor:
        """This rank's share of the step over ``batches`` (the step's micro-batches, (inputs,
        targets, positions, draws, documents) each, on the device; positions None: all of each
        sequence); its summed loss as a float64 scalar on the device (0 off the last stage)."""
        micro = list(batches)
        self.model.train()
        self.recorder = Recorder(self.mesh.pp.rank)
        loss = executor.run(
            self.plan,
            self.chunks,
            self.mesh.pp,
            loss_fn=lambda i, logits: self.model.train_loss(lm_loss(logits, micro[i][1])),
            recorder=self.recorder,
            **self._io(micro),
        )
        self.peak = max(self.peak, self.recorder.peak_bytes)
        return loss

    def forward_only(self, batches) -> None:
        """This rank's forwards of the step's schedule without gradients or a loss (the routing
        count's: ``routing_count``); none without micro-batches."""
        micro = list(batches)
        if micro:
            executor.forward_only(self.plan, self.chunks, self.mesh.pp, **self._io(micro))

    def _io(self, micro: list) -> dict:
        """The executor's inputs and activation buffers for the micro-batches ``micro``."""
        return dict(
            feed=lambda i: micro[i][0],
            act_shape=(*micro[0][0].shape, self.model.cfg.dim),
            act_dtype=self.dtype,
            device=self.device,
            inputs=lambda i: micro[i][2:],  # each chunk's positions and dropout draws
        )

    @property
    def activation_peak(self) -> int:
        """The most bytes of activations this rank held for backward at once, over the run's steps
        (the recorder's count: saved tensors plus each chunk's input and output)."""
        return self.peak
