"""Host staging buffers an async save copies its tensors into, reused from one save to the next.

An async save blocks the training loop only for this copy (and the collectives around it), so
the copy is the one thing worth making fast: a fresh host tensor per save pays for allocating
and first-touching its pages on every save (at 50M parameters, 150 MB per rank of 4, that was
most of the blocking time: ``benchmarks/checkpoint.py``), where a buffer kept from the previous
save is only written over with ``copy_``. From a CUDA source the buffers are pinned and the
copies are non-blocking; the loop does not wait for them: the writer calls ``wait_copied()``
(an event recorded after the copies) before it reads, and the stream's order keeps the next
optimizer step from changing the source before the copy has read it.

At most one save is in flight, and that is what makes the reuse safe: ``lend(done)`` records
the background write that reads the buffers, and ``stage`` refuses to overwrite them until
``done()`` is true. ``hand_over()`` gives the last staged tensors away for good (a caller that
keeps them, e.g. as the snapshot a resume check compares with); the next save allocates anew,
or reuses what ``take_back`` returned.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StagingBuffers:
    """Host copies of a dict of tensors, in buffers kept across ``stage`` calls."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._reader: Callable[[], bool] | None = None  # done() of the write reading the buffers
        self._copied: torch.cuda.Event | None = None  # recorded after CUDA copies
        self._keys: set[str] = set()  # every key staged so far

    def stage(self, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy every source into its host buffer (allocated on first use, or when its shape or
        dtype changed); returns the buffers, keyed like ``sources``. Raises RuntimeError while
        the write the buffers were lent to is still running."""
        if self._reader is not None and not self._reader():
            raise RuntimeError("staging buffers are still being written from: at most one save in flight")
        self._reader, self._copied = None, None
        on_cuda = [s for s in sources.values() if s.device.type == "cuda"]
        for key, source in sources.items():
            cuda = source.device.type == "cuda"
            buffer = self._buffers.get(key)
            if (
                buffer is None
                or buffer.shape != source.shape
                or buffer.dtype != source.dtype
                or (cuda and not buffer.is_pinned())
            ):
                buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=cuda)
                self._buffers[key] = buffer
            buffer.copy_(source, non_blocking=cuda)
        self._keys.update(sources)
        if on_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(on_cuda[0].device))
        return {key: self._buffers[key] for key in sources}

    def wait_copied(self) -> None:
        """Wait until the last ``stage``'s copies have landed (from a CUDA source; else at once).
        The background writer calls it before it reads the buffers."""
        if self._copied is not None:
            self._copied.synchronize()

    def lend(self, done: Callable[[], bool]) -> None:
        """The buffers are read by a write until ``done()`` is true; ``stage`` waits for no one
        and refuses until then."""
        self._reader = done

    def hand_over(self) -> None:
        """The last staged tensors now belong to the caller: they are never written again."""
        self._buffers = {}

    def take_back(self, tensors: dict[str, torch.Tensor]) -> None:
        """Host tensors no one reads any more (a replaced snapshot) become the buffers of their keys
        (keys ``stage`` has seen), where there is none. Only contiguous CPU tensors are taken."""
        for key, tensor in tensors.items():
            if (
                key in self._keys
                and key not in self._buffers
                and tensor.device.type == "cpu"
                and tensor.is_contiguous()
            ):
                self._buffers[key] = tensor
