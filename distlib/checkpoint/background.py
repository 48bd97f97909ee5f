"""One rank's shard written in a background thread while training goes on (async saves).

The thread runs ``sharded.write_own_shard`` (write, fsync, sha256) on tensors that were
copied to host memory first, so nothing it reads changes under it. It takes part in no
collective: the ranks agree that every write finished at a later step boundary, and only
then ``sharded.complete_save`` gathers the file entries and rank 0 commits the manifest.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BackgroundWrite:
    """``fn()`` running in a daemon thread; ``result()`` waits for it and returns its value or
    raises its exception. A process that dies leaves at most an uncommitted partial directory."""

    def __init__(self, fn: Callable[[], dict], name: str = "checkpoint-write"):
        self._fn = fn
        self._value: dict | None = None
        self._error: BaseException | None = None
        self.began = time.perf_counter()
        self.seconds: float | None = None  # how long the write took, once done
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the result
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - self.began

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> dict:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
