"""Handle ids of one worker-side session: values the worker keeps for the client, named by small integers.

The client chooses the ids (never reused within a connection's session, so
a stale id can never name a later value) and tells the worker which ones it
no longer needs by queueing them here when their local stand-in dies; the
queue rides on the next request (``Pending.handles``), so freeing costs no
round trip of its own. Saved activations (training) and values that stay on
the worker (:mod:`remotorch.client.remote`) share this id space.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque


class HandleTable:
    """Hands out handle ids and queues the ids of released ones."""

    def __init__(self) -> None:
        self._next = 1
        self._lock = threading.Lock()
        self._released: deque[int] = deque()
        self.releasing_bytes = 0  # bytes of the values released and not taken yet, where known (a hint)
        self._live: set[int] = set()  # handles the worker holds for us now
        # handle id -> weakly, the value standing here for it (client.remote.RemoteRef), until released
        # (a plain dict: the value's death releases its handle, which drops the entry; a third of what
        # a WeakValueDictionary costs, at one per eager call)
        self._values: dict[int, weakref.ref] = {}
        self._stand_ins: dict[weakref.ref, int] = {}  # weak reference to a stand-in -> its handle id

    def reserve(self, n: int) -> int:
        """The first of ``n`` fresh, consecutive handle ids."""
        with self._lock:
            base = self._next
            self._next += n
            return base

    def seen(self, hid: int) -> None:
        """Never hand out ``hid`` again (the worker used it), and count it as held."""
        if hid >= self._next:  # (ids reserved here are below it already: no lock then)
            with self._lock:
                self._next = max(self._next, hid + 1)
        self._live.add(hid)

    def held_by(self, stand_in: object, hid: int) -> None:
        """Count reserved id ``hid`` as held while ``stand_in`` lives; its death releases it.

        (A weak reference with a callback: a third of what ``weakref.finalize``
        costs, which matters at one per saved activation per step.)
        """
        self._live.add(hid)
        self._stand_ins[weakref.ref(stand_in, self._died)] = hid

    def _died(self, ref: weakref.ref) -> None:
        hid = self._stand_ins.pop(ref, None)
        if hid is not None:
            self.release(hid)

    def release(self, hid: int, nbytes: int = 0) -> None:
        """The worker may drop ``hid`` (safe from garbage collection, on any thread: set, dict and deque ops
        only; ``nbytes``, the value's size where known, only counts towards :attr:`releasing_bytes`)."""
        self._live.discard(hid)
        self._values.pop(hid, None)
        self._released.append(hid)
        if nbytes:
            self.releasing_bytes += nbytes  # (a count lost to a race only delays a release)

    def track(self, value) -> None:
        """Remember a local stand-in for handle ``value.handle`` while it lives (see :meth:`values`)."""
        self._values[value.handle] = weakref.ref(value)

    def values(self) -> list:
        """The stand-ins of handles still held here (to fetch them all before the session ends)."""
        return [v for v in map(weakref.ref.__call__, list(self._values.values())) if v is not None]

    @property
    def live(self) -> int:
        """Handles the worker holds for us now."""
        return len(self._live)

    @property
    def releasing(self) -> int:
        """Ids released and not taken yet."""
        return len(self._released)

    def take_released(self) -> list[int]:
        """Ids released since the last call (to piggy-back on the next request)."""
        out = []
        self.releasing_bytes = 0
        while self._released:
            out.append(self._released.popleft())
        return out


def spans_of(ids: list[int], least: int = 3) -> tuple[list[int], list[list[int]]]:
    """Released handle ids as (single ids, [first, count] runs of at least ``least`` consecutive ones)."""
    if len(ids) < least:
        return ids, []
    single, spans = [], []
    ids = sorted(ids)
    i = 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + 1:
            j += 1
        if j - i >= least:
            spans.append([ids[i], j - i])
        else:
            single.extend(ids[i:j])
        i = j
    return single, spans
