"""Run requests on one chosen thread (the worker's main thread).

PyTorch's CPU kernels run markedly slower when their parallel regions start
from a secondary thread (measured on a 2-core machine: a small MLP took
~220 µs from a thread vs ~108 µs from the main thread), so connection threads
only move bytes and hand every request to the thread that owns the device.
This also serializes graph runs, so one call's timing is not disturbed by
another's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = object()


class _Call:
    __slots__ = ("fn", "args", "done", "result", "error")

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class ThreadExecutor:
    """A queue of calls drained by whichever thread runs :meth:`run_forever`."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()

    def call(self, fn: Callable, *args) -> Any:
        """Run ``fn(*args)`` on the executor thread and return its result (or raise its error)."""
        if self._stopped.is_set():
            raise RuntimeError("executor stopped")
        item = _Call(fn, args)
        self._queue.put(item)
        item.done.wait()
        if item.error is not None:
            raise item.error
        return item.result

    def run_forever(self) -> None:
        """Drain calls until :meth:`stop`; calls still queued then fail."""
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            try:
                item.result = item.fn(*item.args)
            except BaseException as exc:  # handed back to the caller's thread
                item.error = exc
            item.done.set()
        self._fail_pending()

    def _fail_pending(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                item.error = RuntimeError("worker shutting down")
                item.done.set()

    def stop(self) -> None:
        self._stopped.set()
        self._queue.put(_STOP)
