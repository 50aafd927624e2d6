"""The limits a worker enforces, and memory accounting for uploads: per-session quota,
worker-wide limit, eviction order.

What a session holds is counted against its quota in full, also when another
session holds the same content (a session's usage must not depend on what
others upload). Before the worker refuses anything for its own memory limit,
it evicts cached objects that no session holds, least recently orphaned first.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from ..errors import QuotaExceededError
from .store import SharedStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Size, memory and time limits a worker enforces on every request."""

    max_tensor_bytes: int = 1 << 36
    max_graph_bytes: int = 256 << 20
    memory_quota: int | None = None  # bytes one session may hold (resident tensors, graphs)
    memory_limit: int | None = None  # bytes all sessions and the cache may hold together
    cache_bytes: int = 0  # per store: objects no session holds, kept for re-adoption (0: none)
    request_timeout: float | None = None  # seconds one graph may run (checked between operators)


def reserve(stores: tuple[SharedStore, ...], session: object, nbytes: int, *,
            quota: int | None, limit: int | None, other_held: int = 0, other_live: int = 0) -> None:
    """Make room for ``nbytes`` more held by ``session``, or raise QuotaExceededError.

    ``other_held``/``other_live``: bytes outside the stores (training state)
    that the session, and all sessions, hold.
    """
    if quota is not None:
        held = other_held + sum(s.session_bytes(session) for s in stores)
        if held + nbytes > quota:
            raise QuotaExceededError(f"session would hold {held + nbytes} bytes on the worker, over its "
                                     f"memory quota of {quota} (holds {held} now)")
    if limit is not None:
        live = other_live + sum(s.total_bytes for s in stores)
        over = live + sum(s.orphan_bytes for s in stores) + nbytes - limit
        for store in stores:
            if over <= 0:
                break
            over -= store.evict(over)
        if live + nbytes > limit:
            raise QuotaExceededError(f"the worker's memory limit of {limit} bytes is reached "
                                     f"({live} held by sessions, {nbytes} more asked)")


def release_cached(stores: tuple[SharedStore, ...], device: torch.device) -> int:
    """Evict every cached object no session holds and return memory to the device; bytes freed."""
    freed = sum(s.evict() for s in stores)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if freed:
        log.info("out of memory: evicted %d cached bytes no session used", freed)
    return freed


def is_out_of_memory(exc: BaseException) -> bool:
    """True for CUDA OOM, ``MemoryError`` and the CPU allocator's failure (a RuntimeError)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
