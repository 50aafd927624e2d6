"""Every value a worker keeps for a session by handle id, whatever made it.

A handle is a small integer the client chose (never reused within a client
session, so a stale id can never name a new value). The same store holds:

* activations a training forward saved for its backward (``Run.saved_from``);
* outputs kept on the worker until Python reads them (``Run.keep``);
* large inputs kept for a later graph of the same call (``Run.keep_inputs``);
* tensors another worker delivered under a ticket (``Deliver``).

Graphs name them as ``HandleArg`` or ``ViewArg``; ``Fetch`` reads them; the
client's deferred housekeeping (``Pending.handles``) drops them. Nothing here
knows about messages or sockets.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from itertools import chain

import torch

from ..errors import InvalidRequestError, MissingObjectsError


def nbytes(t: torch.Tensor | None) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def count_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of these tensors, each object counted once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += nbytes(t)
    return total


_GONE = object()


def held_bytes(store: HandleStore, session: object | None, others: Iterable) -> int:
    """Bytes of a session's handles (None: every session's) and of ``others`` (tensors held otherwise:
    the training state), each object once, as :func:`count_bytes` over both counts them; the handles'
    from the sums the store keeps once tracked (a memory quota asks before every output kept, and a
    session may keep thousands of values)."""
    if not store.tracking:
        return count_bytes(chain(store.tensors(session), others))
    held = store.objects(session)
    total = store.total_bytes if session is None else store.nbytes(session)
    seen: set[int] = set()
    for t in others:
        if isinstance(t, torch.Tensor) and id(t) not in held and id(t) not in seen:
            seen.add(id(t))
            total += nbytes(t)
    return total


class HandleStore:
    """Handle id -> tensor, per session.

    Once :meth:`track` was called (by a worker with a memory quota or a
    memory limit at start-up, by a service when it sets up tenants), it keeps
    the bytes its tensors hold as they come and go, each tensor object
    counted once however many handles name it (as :func:`count_bytes`
    counts): the quota asks for them before every output a run keeps, and a
    sum over every value held would make each eager call cost as much as the
    values the session keeps. Without, storing and releasing a handle costs
    a dict operation.
    """

    #: the longest a request waits for a handle another worker is to deliver (the serving loop waits)
    wait_s = 60.0

    def __init__(self) -> None:
        self._sessions: dict[object, dict[int, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # a delivery stored handles
        self._expected: dict[object, dict[int, float]] = {}  # session -> handle id -> deadline (monotonic)
        # each tensor object held: id -> [handles (sessions) naming it, its bytes], per session and over all
        self._refs: dict[object, dict[int, list]] = {}
        self._all: dict[int, list] = {}
        self._bytes: dict[object, int] = {}  # per session, each object once
        self.total_bytes = 0  # over every session, each object once
        self.tracking = False  # (see track)

    def track(self) -> None:
        """Keep the bytes held from now on (counting what is held now, once)."""
        with self._lock:
            if self.tracking:
                return
            self.tracking = True
            for session, held in self._sessions.items():
                for t in held.values():
                    self._ref(session, t)

    def count(self) -> int:
        """Tensors kept by handle, all sessions together."""
        return sum(len(held) for held in list(self._sessions.values()))

    def _of(self, session: object) -> dict[int, torch.Tensor]:
        held = self._sessions.get(session)
        if held is None:
            with self._lock:
                held = self._sessions.setdefault(session, {})
        return held

    def drop_session(self, session: object) -> None:
        with self._lock:
            held = self._sessions.pop(session, None)
            self._expected.pop(session, None)
            refs = self._refs.get(session)
            if refs is not None:
                for t in (held or {}).values():
                    self._unref(refs, session, id(t))
            self._refs.pop(session, None)
            self._bytes.pop(session, None)

    def _ref(self, session: object, t) -> None:
        """One more handle of ``session`` names ``t`` (the lock is held). The handles hold the object,
        so its id names it while any counts it."""
        key = id(t)
        refs = self._refs.get(session)
        if refs is None:
            refs = self._refs[session] = {}
        r = refs.get(key)
        if r is not None:
            r[0] += 1
            return
        n = nbytes(t)
        refs[key] = [1, n]
        self._bytes[session] = self._bytes.get(session, 0) + n
        a = self._all.get(key)
        if a is None:
            self._all[key] = [1, n]
            self.total_bytes += n
        else:
            a[0] += 1  # (another session holds it too: counted once over all)

    def _unref(self, refs: dict, session: object, key: int) -> None:
        """A handle of ``session`` naming the object ``key`` is gone (the lock is held)."""
        r = refs.get(key)
        if r is None:
            return
        r[0] -= 1
        if r[0]:
            return
        del refs[key]
        n = r[1]
        self._bytes[session] -= n
        a = self._all[key]
        a[0] -= 1
        if not a[0]:
            del self._all[key]
            self.total_bytes -= n

    def nbytes(self, session: object) -> int:
        """Bytes of the tensors a session's handles name, each object once (kept once tracked)."""
        if not self.tracking:
            return count_bytes(self.tensors(session))
        return self._bytes.get(session, 0)

    def objects(self, session: object | None = None) -> dict[int, list]:
        """The ids of the tensor objects held (one session's, or every session's), each -> [handles (or
        sessions) naming it, its bytes]; read only."""
        return self._all if session is None else self._refs.get(session) or {}

    def expect(self, session: object, ids: list[int], deadline: float) -> None:
        """Another worker is to deliver these handles (a ticket is out): a request that needs one
        before it arrives waits for it, until ``deadline`` or :attr:`wait_s`, whichever is sooner."""
        with self._lock:
            self._expected.setdefault(session, {}).update(dict.fromkeys(ids, deadline))

    def held(self, session: object) -> dict[int, torch.Tensor]:
        """The session's handles now, to look up many at once (read only; on a miss, ask :meth:`get`)."""
        return self._sessions.get(session) or {}

    def get(self, session: object, hid: int) -> torch.Tensor:
        try:
            return self._of(session)[hid]
        except KeyError:
            pass
        with self._lock:
            deadline = self._expected.get(session, {}).get(hid)
            if deadline is not None:  # on its way from another worker: the pipeline's order, kept here
                deadline = min(deadline, time.monotonic() + self.wait_s)
                while hid not in self._of_locked(session) and time.monotonic() < deadline:
                    self._arrived.wait(max(0.0, deadline - time.monotonic()))
            held = self._sessions.get(session, {})
            if hid in held:
                return held[hid]
        raise MissingObjectsError(f"handle {hid} is not held by this session (released, not delivered, or "
                                  "the connection was lost)", handles=[hid])

    def _of_locked(self, session: object) -> dict[int, torch.Tensor]:
        return self._sessions.get(session, {})

    def put(self, session: object, ids: list[int], tensors: list[torch.Tensor]) -> None:
        """Store tensors as these handles; every id must be new to the session."""
        held = self._of(session)
        with self._lock:
            if len(ids) == 1:  # (most: an eager call's one output)
                if ids[0] in held:
                    raise InvalidRequestError("handle ids are already in use")
                held[ids[0]] = tensors[0]
                if self.tracking:
                    self._ref(session, tensors[0])
            else:
                if len(set(ids)) != len(ids) or any(h in held for h in ids):
                    raise InvalidRequestError("handle ids are already in use")
                for h, t in zip(ids, tensors):
                    held[h] = t
                    if self.tracking:
                        self._ref(session, t)
            expected = self._expected.get(session)
            if expected:
                for h in ids:
                    expected.pop(h, None)
                self._arrived.notify_all()

    def view(self, session: object, hid: int, shape: list[int], strides: list[int], offset: int) -> torch.Tensor:
        """A view of a handle's tensor, ``offset`` elements from its origin; checked to stay in its storage."""
        base = self.get(session, hid)
        if len(shape) != len(strides) or len(shape) > 64:
            raise InvalidRequestError("view: shape and strides disagree")
        if not all(type(v) is int and 0 <= v < 1 << 62 for v in (*shape, *strides, offset)):
            raise InvalidRequestError("view: size, stride or offset out of range")
        start = base.storage_offset() + offset
        last = start + sum((n - 1) * st for n, st in zip(shape, strides))
        room = base.untyped_storage().nbytes() // base.element_size()
        if all(n > 0 for n in shape) and last >= room:
            raise InvalidRequestError("view: reaches past the handle's storage")
        return torch.as_strided(base, shape, strides, start)

    def release(self, session: object, ids: Iterable[int]) -> None:
        """Forget handles; ids the session does not hold are ignored."""
        held = self._sessions.get(session)
        if held is None:
            return
        if not self.tracking:
            expected = self._expected.get(session)
            for h in ids:
                held.pop(h, None)
                if expected:
                    expected.pop(h, None)
            return
        with self._lock:
            expected = self._expected.get(session)
            refs = self._refs.get(session)
            for h in ids:
                t = held.pop(h, _GONE)
                if t is not _GONE and refs is not None:
                    self._unref(refs, session, id(t))
                if expected:
                    expected.pop(h, None)

    def tensors(self, session: object | None = None) -> Iterator[torch.Tensor]:
        """The tensors of one session (None: of every session)."""
        if session is not None:
            yield from list(self._sessions.get(session, {}).values())
            return
        with self._lock:
            stores = list(self._sessions.values())
        for held in stores:
            yield from list(held.values())

