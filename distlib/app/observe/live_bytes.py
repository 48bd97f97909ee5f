"""The bytes of every tensor alive on a rank, at their peak during the training steps.

What ``torch.cuda.max_memory_allocated`` reports on a GPU, counted on any device (the CPU's
allocator keeps no such figure): ``LiveBytes`` is a dispatch mode that sees every tensor an
operator returns, in the forward, the backward (autograd runs its operators through the same
dispatcher), the collectives' buffers and the optimizer's update. A storage counts its bytes once,
when first seen (a view of it adds nothing), and stops counting when Python's weak reference to it
dies, that is when the last tensor on it is freed; an operator that resizes a storage in place
(ZeRO-3's parameter buffers) updates its bytes. What was alive before the meter started is
registered by ``hold`` (the model states), so ``now`` is every tensor alive, not only the new ones.

Only the storages torch allocated on the meter's device count: a host copy of the loss or of a
snapshot is not the accelerator's memory, and a tensor over memory torch did not allocate (not
``resizable``: the shared-memory board's messages, 30 MB a rank of the default transport at 4
ranks; a NumPy array of the corpus) is not the rank's allocation.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self, device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.now = 0  # bytes of the tracked storages alive
        self.peak = 0  # the most ``now`` has been while the mode was entered
        self._bytes: dict[int, int] = {}  # storage key -> bytes counted for it
        self._refs: dict[int, weakref.ref] = {}
        self._resized: set[int] = set()  # storages seen at two sizes, re-read after every operator
        self._ignored: dict[int, weakref.ref] = {}  # storage key -> a weak reference to it

    def hold(self, tensors) -> None:
        """Count ``tensors`` (allocated before the meter saw them) as alive until they are freed."""
        for t in tensors:
            self._track(t)
        self.peak = max(self.peak, self.now)

    def ignore(self, tensors) -> None:
        """Never count the storages of ``tensors`` (not the rank's allocation, as a NumPy array's)
        while they live: a storage made after one dies may take its key."""
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            self._ignored[key] = weakref.ref(storage, lambda _, key=key: self._ignored.pop(key, None))

    def settle(self) -> int:
        """``now``, with the storages resized since the last operator re-read."""
        self._reread()
        return self.now

    def defer(self, nbytes: int) -> None:
        """Go on counting ``nbytes`` already freed (until ``undefer``): what a job of another thread
        freed, which could still be alive, by that thread's timing (``plan.late_frees``)."""
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def undefer(self, nbytes: int) -> None:
        self.now -= nbytes

    def restart(self) -> None:
        """Forget the peak so far: from now on it is the most alive at once from here. A storage
        resized since it was seen (ZeRO-3's unit buffers, made whole and emptied at the build) counts
        its bytes now, and is re-read after every operator from here on (``_reread``)."""
        for key, ref in self._refs.items():
            if ref().nbytes() != self._bytes[key]:
                self._resized.add(key)
        self._reread()
        self.peak = self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._reread()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak = max(self.peak, self.now)
        return out

    def _track(self, t: torch.Tensor) -> None:
        if not self._on_device(t.device):
            return
        storage = t.untyped_storage()
        if not storage.resizable() or storage._cdata in self._ignored:
            return
        key, nbytes = storage._cdata, storage.nbytes()
        known = self._bytes.get(key)
        if known is None:
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        elif known == nbytes:
            return
        else:
            self._resized.add(key)
        self.now += nbytes - (known or 0)
        self._bytes[key] = nbytes

    def _on_device(self, device: torch.device) -> bool:
        """Whether ``device`` is the meter's (``cuda`` names whichever GPU the rank's tensors are on)."""
        if device.type != self.device.type:
            return False
        return self.device.index is None or device.index == self.device.index

    def _reread(self) -> None:
        """A storage resized outside the dispatcher (``UntypedStorage.resize_``: ZeRO-3 frees and
        refills its unit buffers so) counts its bytes now."""
        for key in self._resized:
            nbytes = self._refs[key]().nbytes()
            self.now += nbytes - self._bytes[key]
            self._bytes[key] = nbytes

    def _free(self, key: int) -> None:
        self.now -= self._bytes.pop(key)
        del self._refs[key]
        self._resized.discard(key)


class StepMeter:
    """``metrics.step_peak`` in a run: a ``LiveBytes`` over the model's build and the run's first
    two steps (the first makes what later ones reuse, the causal mask; the second allocates as
    every later one does). Later steps run at full speed: the meter costs a Python call per
    operator (the llama preset over 4 ranks, every one of 20 steps metered: 5.0 s instead of 3.7 s
    end to end). Off, it does nothing."""

    def __init__(self, device, on: bool) -> None:
        self.live = LiveBytes(device) if on else None
        self.last = 2  # the last step metered

    def begin(self, start: int) -> None:
        """The run resumes after step ``start``: meter the two after it."""
        self.last = start + 2

    def watch(self, step: int = 0):
        """The meter over ``step`` (0: the build), or nothing."""
        if self.live is None or step > self.last:
            return contextlib.nullcontext()
        return self.live

    def build(self, build, *args):
        """``build(*args)`` (the model and its optimizer) metered; its temporaries are not a step's."""
        with self.watch():
            built = build(*args)
        if self.live is not None:
            self.live.restart()
        return built

    def fields(self) -> dict[str, int]:
        """``{"step_peak": bytes}`` for the memory figures, or nothing when off."""
        return {} if self.live is None else {"step_peak": self.live.peak}
