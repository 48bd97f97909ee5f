"""The fixed points of a training step where something from outside may act.

The loop calls one ``StepHooks`` object at these points and nothing else, so fault injection
(``distlib.app.runtime.faults.Faults``) attaches from outside the loop instead of living in it; the
default does nothing. ``joining()`` runs once, before the rank joins the process group; then, in
the order a step calls them::

    before_step(step)                       before anything of the step runs
    after_backward(step, grad_buffer)       local gradients ready, before they are synchronised
    lr_factor(step)                         scales this step's learning rate
    after_update(step, parts)               the update is applied and gathered
    after_step(step)                        the step is logged and (maybe) saved

plus ``save_hook(step)`` for each checkpoint save (points inside ``checkpoint.save``) and
``check_model(names)`` once, when the model is built.
"""

from __future__ import annotations

import torch

from distlib.checkpoint.sharded import SaveHook


class StepHooks:
    """Every hook a no-op: a step runs as if nothing were attached."""

    def check_model(self, names: list[str]) -> None:
        """The model is built (``names``: every parameter of this rank's stage); a hook that names a
        parameter fails here, before any step, instead of at the step it fires."""

    def joining(self) -> None:
        """Before this rank joins the process group (train.py)."""

    def before_step(self, step: int) -> None:
        pass

    def after_backward(self, step: int, grad_buffer: torch.Tensor) -> None:
        """``grad_buffer``: this rank's local gradients (stages 2/3: its partition, reduced in backward)."""

    def lr_factor(self, step: int) -> float:
        return 1.0

    def after_update(self, step: int, parts: list[tuple[torch.Tensor, tuple, int]]) -> None:
        """``parts``: per parameter group (one but under dist.ep), ``(params, slots, start)``:
        ``params`` holds the flat offsets [start, start + numel) of ``slots`` this rank keeps."""

    def after_step(self, step: int) -> None:
        pass

    def save_hook(self, step: int) -> SaveHook | None:
        """The hook ``checkpoint.save`` calls inside the save of ``step`` (None: none)."""
        return None
