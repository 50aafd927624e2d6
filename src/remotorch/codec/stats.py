"""What a worker is doing, for its operator (protocol.md §21): the ``Stats`` request of ``remotorch top``.

They live beside :mod:`remotorch.codec.messages`, which takes them into its
``Request`` and ``Reply`` unions; import them from there (``m.Stats``).
"""

from __future__ import annotations

import msgspec


class Stats(msgspec.Struct, frozen=True, tag="stats", omit_defaults=True):
    """Ask for the worker's activity (answered ``StatsReply``); only an operator's token may (§21)."""


class TenantStats(msgspec.Struct, frozen=True, array_like=True):
    """One tenant's share: live sessions, and requests and errors since the worker started."""

    name: str
    sessions: int
    requests: int
    errors: int


class GraphStats(msgspec.Struct, frozen=True, array_like=True):
    """One graph on one engine: runs, their mean and longest time (ms), and its tenant."""

    graph: str  # the first 12 hex digits of its id
    engine: str
    tenant: str
    runs: int
    mean_ms: float
    max_ms: float


class ErrorStats(msgspec.Struct, frozen=True, array_like=True):
    """A recent error: when (seconds since the worker started), whose, what request, what kind, why."""

    at_s: float
    tenant: str
    request: str
    kind: str
    message: str


class StatsReply(msgspec.Struct, frozen=True, tag="stats_reply", omit_defaults=True):
    """The worker's activity now: counters since it started (a viewer takes rates from two replies)."""

    name: str
    device: str
    uptime_s: float
    requests: int
    errors: int
    connections: int
    resident_bytes: int
    cached_bytes: int
    host_memory_bytes: int
    device_memory_bytes: int = 0
    device_memory_total: int = 0
    device_memory_peak: int = 0  # CUDA workers: the most allocated at once since the worker started
    tenants: list[TenantStats] = []
    slowest: list[GraphStats] = []  # by longest run, at most 10
    recent_errors: list[ErrorStats] = []  # newest last, at most 20
    # CUDA graphs (``serve --cuda-graphs``, ``Run.cuda_graphs``): "recorded", "replays", and the runs that
    # went uncaptured, each as "uncaptured: <why>"
    cuda_graphs: dict[str, int] = {}
