"""A time limit for one graph run on the worker's main thread.

PyTorch kernels cannot be interrupted from outside, but an eager graph (and
the Python glue around compiled kernels) returns to the interpreter between
operators. A ``SIGALRM`` timer raises :class:`DeadlineExpired` there, so a
graph that runs too long stops at the next operator boundary and the worker
answers an error instead of holding every session hostage. One kernel that
runs long by itself finishes first.

Signals reach only the main thread, so off the main thread (in-process use
from another thread) the limit is not applied.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class DeadlineExpired(BaseException):
    """Raised inside the running graph when its time is up.

    A ``BaseException`` so that ``except Exception`` blocks inside the graph's
    own code cannot swallow it.
    """


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Raise :class:`DeadlineExpired` in the body if it runs longer than ``seconds`` (None: no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    armed = [True]

    def on_alarm(signum, frame) -> None:
        if armed[0]:
            armed[0] = False
            raise DeadlineExpired(f"request ran longer than {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
