"""Content-addressed objects shared by sessions, each session seeing only its own.

A session can reference an id only after it uploaded the bytes itself, so the
shared cache tells nobody what others hold. Objects are freed when the last
session that uploaded them goes away.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Entry:
    value: Any
    nbytes: int
    holders: set = field(default_factory=set)


class SharedStore:
    """Objects by content id, with per-session visibility and reference counting."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._by_session: dict[object, set[str]] = {}
        self._lock = threading.Lock()
        self.total_bytes = 0

    def put(self, session: object, key: str, value: Any, nbytes: int) -> None:
        """Add (or re-reference) an object for a session."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(value, nbytes)
                self.total_bytes += nbytes
            entry.holders.add(session)
            self._by_session.setdefault(session, set()).add(key)

    def get(self, session: object, key: str) -> Any:
        """The object if this session holds it, else KeyError."""
        entry = self._entries.get(key)
        if entry is None or session not in entry.holders:
            raise KeyError(key)
        return entry.value

    def missing(self, session: object, keys: Iterable[str]) -> list[str]:
        """The keys of ``keys`` this session does not hold."""
        held = self._by_session.get(session, ())
        return [k for k in keys if k not in held]

    def session_bytes(self, session: object) -> int:
        with self._lock:
            return sum(self._entries[k].nbytes for k in self._by_session.get(session, ()))

    def drop_session(self, session: object) -> list[str]:
        """Forget a session; returns the keys whose last holder it was (now freed)."""
        freed = []
        with self._lock:
            for key in self._by_session.pop(session, set()):
                entry = self._entries[key]
                entry.holders.discard(session)
                if not entry.holders:
                    del self._entries[key]
                    self.total_bytes -= entry.nbytes
                    freed.append(key)
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
                entry.holders.discard(session)
                if not entry.holders:
                    del self._entries[key]
                    self.total_bytes -= entry.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def sessions(self) -> int:
        return len(self._by_session)
