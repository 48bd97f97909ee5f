"""How many bytes of activations autograd keeps from the forward for the backward, per rank.

``ActivationMeter.measure(model)`` wraps a forward in ``torch.autograd.graph.saved_tensors_hooks``:
every tensor an operation saves for backward passes through the pack hook, which counts the bytes
of its storage once (several saved views of one storage -- q, k, v of one qkv output -- hold one
allocation) and skips the model's parameters and buffers (model state, counted by the memory
profile already), until the storage is freed: what a branch the forward dropped saved (an output
nothing used frees its graph) is not kept, and its storage's key may name a new storage next,
which would otherwise pass uncounted (DeepSeek-V3's dry steps measured 2 KB apart from one run to
the next so). The total at the end of the forward is what lives between forward and backward.

With ``model.activation_checkpointing=blocks`` torch's checkpoint installs its own, inner hooks
inside each block and saves nothing there; what the checkpoint keeps is the block's input, which
``Block`` reports through ``keep`` (the only tensor a checkpointed block holds on to). The backward
then recomputes one block at a time; those recomputed activations live only while that block's
backward runs and are not in this figure.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn

_active: list[ActivationMeter] = []  # the meter measuring the forward now running, if any


def keep(tensor: torch.Tensor) -> None:
    """A tensor kept for the backward outside autograd's saved tensors (a checkpoint's input)."""
    if _active:
        _active[-1]._count(tensor)


class ActivationMeter:
    def __init__(self) -> None:
        self.peak = 0  # the largest forward seen (bytes kept for its backward)
        self._state: set[int] = set()
        self._seen: dict[int, weakref.ref] = {}  # storage key -> a weak reference to it
        self._bytes = 0

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata  # the storage itself: identical for every view of it, stable across resize_
        if key not in self._seen and key not in self._state:
            nbytes = storage.nbytes()
            self._seen[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._freed(key, nbytes))
            self._bytes += nbytes

    def _freed(self, key: int, nbytes: int) -> None:
        """A saved tensor freed before the backward (its branch of the graph was dropped: an
        output nothing used) is not kept for it; and its key may name a new storage next."""
        if self._seen.pop(key, None) is not None:
            self._bytes -= nbytes

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._count(tensor)
        return tensor.detach()  # same storage; a saved output kept with its grad_fn would form a cycle

    @contextlib.contextmanager
    def measure(self, model: nn.Module):
        """Count what ``model``'s forward inside the block saves for backward; the peak is updated
        when the block ends."""
        # Parameters may be re-pointed between steps (ZeRO-3 unit buffers), so collected per forward.
        self._state = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
        self._seen, self._bytes = {}, 0
        _active.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            _active.pop()
            self.peak = max(self.peak, self._bytes)
