"""What a worker has been doing, for its operator: the ``Stats`` reply that ``remotorch top`` shows.

Counted by the server after each request (:meth:`Activity.record`): requests
and errors by tenant, each graph's runs by engine (their mean and longest
time), and the last errors. Nothing here holds a token, a session id or a
tensor: a graph is named by the first digits of its content id.
"""

from __future__ import annotations

import collections
import os
import resource
import sys
import time

import torch

from ..codec import messages as m

MAX_GRAPHS = 4096  # graph and engine pairs followed (the least run are forgotten first)


class Activity:
    """Counters since the worker started (the serving loop writes, a Stats request reads)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.requests = self.errors = 0
        self.tenants: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # name -> [requests, errors]
        self.graphs: dict[tuple[str, str], list] = {}  # (graph, engine) -> [tenant, runs, total ms, max ms]
        self.recent: collections.deque = collections.deque(maxlen=20)

    def record(self, tenant: str, body, error: m.ErrorReply | None, run: tuple[str, float] | None) -> None:
        """One request served: ``error`` its error reply, ``run`` (engine, ms) of a graph it ran."""
        counts = self.tenants[tenant]
        counts[0] += 1
        self.requests += 1
        if error is not None:
            counts[1] += 1
            self.errors += 1
            kind = type(body).__struct_config__.tag if body is not None else "malformed"
            self.recent.append(m.ErrorStats(round(time.monotonic() - self.started, 3), tenant, kind, error.kind,
                                            error.message[:300]))
        if run is not None and type(body) is m.Run:
            engine, ms = run
            key = (body.graph_id[:12], engine)
            entry = self.graphs.get(key)
            if entry is None:
                if len(self.graphs) >= MAX_GRAPHS:
                    del self.graphs[min(self.graphs, key=lambda k: self.graphs[k][1])]
                entry = self.graphs[key] = [tenant, 0, 0.0, 0.0]
            entry[1] += 1
            entry[2] += ms
            if ms > entry[3]:
                entry[3] = ms

    def reply(self, service) -> m.StatsReply:
        worker = service.worker
        memory = worker.memory()
        device = worker.device
        allocated = total = peak = 0
        if device.type == "cuda":
            allocated, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
            total = torch.cuda.get_device_properties(device).total_memory
        sessions = sessions_by_tenant(service)
        names = sorted(set(sessions) | set(self.tenants))
        tenants = [m.TenantStats(n, sessions.get(n, 0), *self.tenants.get(n, (0, 0))) for n in names]
        slowest = sorted(self.graphs.items(), key=lambda kv: -kv[1][3])[:10]
        return m.StatsReply(
            name=worker.name, device=str(device), uptime_s=round(time.monotonic() - self.started, 3),
            requests=self.requests, errors=self.errors, connections=len(service._connections),
            resident_bytes=memory["tensor_bytes"] + memory["graph_bytes"] + memory["state_bytes"],
            cached_bytes=memory["cached_bytes"], host_memory_bytes=rss(), device_memory_bytes=allocated,
            device_memory_total=total, device_memory_peak=peak, tenants=tenants,
            slowest=[m.GraphStats(g, e, v[0], v[1], round(v[2] / max(v[1], 1), 3), round(v[3], 3))
                     for (g, e), v in slowest],
            recent_errors=list(self.recent), cuda_graphs=dict(worker.recordings.counts))


def error_of(header: bytes) -> m.ErrorReply | None:
    """A reply header's error, or None for any other reply (most are not decoded again)."""
    if b"\xa4type\xa5error" not in header[:16]:  # (the reply body's tag comes first)
        return None
    try:
        reply = m.decode(header)
    except Exception:  # noqa: BLE001 (not ours to judge here)
        return None
    return reply if isinstance(reply, m.ErrorReply) else None


def sessions_by_tenant(service) -> dict[str, int]:
    """Live sessions by tenant name ("" without tenants)."""
    tenancy = service.tenancy
    if tenancy is None:
        return {"": service.sessions()}
    out = {name: 0 for name in tenancy.tenants.names()}
    for _ in range(3):  # (the serving loop may change the tables meanwhile: read again)
        try:
            out.update(tenancy.session_counts())
            break
        except RuntimeError:
            continue
    return out


def rss() -> int:
    """The worker process's resident set, in bytes."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the peak, where nothing better exists
        return peak if sys.platform == "darwin" else peak * 1024
