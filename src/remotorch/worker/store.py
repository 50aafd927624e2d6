"""Content-addressed objects shared by sessions, each session seeing only its own.

A session can reference an id only after it uploaded the bytes itself, so the
shared cache tells nobody what others hold. When the last session that
uploaded an object goes away, the object is freed, or (when ``keep_bytes`` is
set) moves to a bounded cache of objects no session uses (least recently
orphaned evicted first, and evicted before any session's memory when memory
runs short); a session that uploads the same bytes again adopts it from there
(a compiled graph stays compiled).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Entry:
    value: Any
    nbytes: int
    holders: set = field(default_factory=set)


class SharedStore:
    """Objects by content id, with per-session visibility and reference counting."""

    def __init__(self, keep_bytes: int = 0) -> None:
        self._entries: dict[str, _Entry] = {}
        self._by_session: dict[object, set[str]] = {}
        self._session_bytes: dict[object, int] = {}  # bytes of what each session holds (kept as they change)
        self._lock = threading.Lock()
        self.total_bytes = 0
        self.keep_bytes = keep_bytes  # bound of the cache of objects no session holds
        self._orphans: OrderedDict[str, _Entry] = OrderedDict()
        self.orphan_bytes = 0

    def put(self, session: object, key: str, value: Any, nbytes: int) -> None:
        """Add (or re-reference) an object for a session."""
        with self._lock:
            entry = self._entries.get(key) or self._revive(key)
            if entry is None:
                entry = self._entries[key] = _Entry(value, nbytes)
                self.total_bytes += nbytes
            self._hold(session, key, entry)

    def _hold(self, session: object, key: str, entry: _Entry) -> None:
        entry.holders.add(session)
        keys = self._by_session.setdefault(session, set())
        if key not in keys:
            keys.add(key)
            self._session_bytes[session] = self._session_bytes.get(session, 0) + entry.nbytes

    def adopt(self, session: object, key: str) -> bool:
        """Let a session hold an object that is already stored (live or cached); False if absent.

        Callers adopt only after verifying that the session sent the object's
        bytes (content id recomputed), so adopting reveals nothing the session
        did not already have.
        """
        with self._lock:
            entry = self._entries.get(key) or self._revive(key)
            if entry is None:
                return False
            self._hold(session, key, entry)
            return True

    def _revive(self, key: str) -> _Entry | None:
        entry = self._orphans.pop(key, None)
        if entry is not None:
            self.orphan_bytes -= entry.nbytes
            self._entries[key] = entry
            self.total_bytes += entry.nbytes
        return entry

    def evict(self, nbytes: int | None = None) -> int:
        """Free cached objects no session holds, oldest first, until ``nbytes`` are freed (all if None)."""
        freed = 0
        with self._lock:
            while self._orphans and (nbytes is None or freed < nbytes):
                _, entry = self._orphans.popitem(last=False)
                self.orphan_bytes -= entry.nbytes
                freed += entry.nbytes
        return freed

    def values(self) -> list:
        """Every object held by a session (not those only cached)."""
        with self._lock:
            return [e.value for e in self._entries.values()]

    def session_keys(self, session: object) -> frozenset[str]:
        """The ids a session holds (a copy)."""
        with self._lock:
            return frozenset(self._by_session.get(session, ()))

    def get(self, session: object, key: str) -> Any:
        """The object if this session holds it, else KeyError."""
        entry = self._entries.get(key)
        if entry is None or session not in entry.holders:
            raise KeyError(key)
        return entry.value

    def getter(self, session: object, default: Any) -> Callable[[str], Any]:
        """``get(key)``: the object if this session holds it, else ``default`` (many lookups, one setup)."""
        entries = self._entries

        def get(key: str) -> Any:
            entry = entries.get(key)
            return entry.value if entry is not None and session in entry.holders else default
        return get

    def missing(self, session: object, keys: Iterable[str]) -> list[str]:
        """The keys of ``keys`` this session does not hold."""
        held = self._by_session.get(session, ())
        return [k for k in keys if k not in held]

    def session_bytes(self, session: object) -> int:
        """Bytes of the objects a session holds (a sum kept as they come and go: a memory quota asks
        for it before every output a run keeps)."""
        return self._session_bytes.get(session, 0)

    def drop_session(self, session: object) -> list[str]:
        """Forget a session; returns the keys whose last holder it was (now cached or freed)."""
        freed = []
        with self._lock:
            self._session_bytes.pop(session, None)
            for key in self._by_session.pop(session, set()):
                entry = self._entries[key]
                entry.holders.discard(session)
                if not entry.holders:
                    del self._entries[key]
                    self.total_bytes -= entry.nbytes
                    freed.append(key)
                    if 0 < entry.nbytes <= self.keep_bytes:
                        self._orphans[key] = entry
                        self.orphan_bytes += entry.nbytes
            while self.orphan_bytes > self.keep_bytes:
                _, entry = self._orphans.popitem(last=False)
                self.orphan_bytes -= entry.nbytes
        return freed

    def release(self, session: object, keys) -> None:
        """Drop a session's hold on some keys (freed when it was the last holder)."""
        with self._lock:
            held = self._by_session.get(session, set())
            for key in keys:
                if key not in held:
                    continue
                held.discard(key)
                entry = self._entries[key]
                self._session_bytes[session] -= entry.nbytes
                entry.holders.discard(session)
                if not entry.holders:
                    del self._entries[key]
                    self.total_bytes -= entry.nbytes

    def __len__(self) -> int:
        return len(self._entries)
