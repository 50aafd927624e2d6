"""Prometheus metrics of a worker (``remotorch serve --metrics HOST:PORT``), through ``prometheus_client``.

Counted as requests are served (by the serving loop, on its thread):

* ``remotorch_requests_total{tenant,type}``: every request message, by the
  tenant of its connection and its type (``run``, ``put_tensors``, ``health``…);
* ``remotorch_errors_total{tenant,type,kind}``: those answered with an error,
  by the error's kind (``missing``, ``quota``, ``auth``…);
* ``remotorch_received_bytes_total{tenant}``, ``remotorch_sent_bytes_total{tenant}``:
  message bytes in and out (headers and buffer frames);
* ``remotorch_run_seconds{engine}``: a histogram of graph run times on the worker.

Read when scraped (a collector; nothing is kept up to date in between):

* ``remotorch_sessions{tenant}``, ``remotorch_connections``, ``remotorch_values``
  (tensors kept by handle), ``remotorch_resident_bytes``, ``remotorch_cached_bytes``;
* ``remotorch_host_memory_bytes`` (the process's resident set),
  ``remotorch_device_memory_bytes`` (allocated on the worker's CUDA device);
* ``remotorch_disk_cache_{hits,misses,writes}_total``, ``remotorch_disk_cache_bytes``;
* ``remotorch_unacknowledged_requests``: requests run whose replies their
  clients have not yet acknowledged, over all sessions: how far ahead the
  clients' queues run (see the client's request stream).

The HTTP endpoint binds to loopback unless told otherwise; it serves
``/metrics`` in the Prometheus text format and nothing secret (no tokens, no
tensor bytes, no ids).
"""

from __future__ import annotations

import torch

from ..codec import messages as m
from .activity import rss, sessions_by_tenant

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 30.0, 60.0)


def request_type(body) -> str:
    """The wire name of a request (its tag), e.g. ``run``."""
    return type(body).__struct_config__.tag or type(body).__name__


class Metrics:
    """The worker's metrics registry: counters the service updates, gauges read at scrape time."""

    def __init__(self, service) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Histogram
        except ImportError:
            raise ValueError("--metrics needs prometheus_client: pip install 'remotorch[metrics]'") from None
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("remotorch_requests", "Requests served, by tenant and request type.",
                                ["tenant", "type"], registry=r)
        self.errors = Counter("remotorch_errors", "Requests answered with an error, by tenant, request type "
                              "and error kind.", ["tenant", "type", "kind"], registry=r)
        self.received = Counter("remotorch_received_bytes", "Request bytes received (headers and frames).",
                                ["tenant"], registry=r)
        self.sent = Counter("remotorch_sent_bytes", "Reply bytes sent (headers and frames).", ["tenant"], registry=r)
        self.runs = Histogram("remotorch_run_seconds", "Graph run time on the worker, by engine.", ["engine"],
                              buckets=BUCKETS, registry=r)
        r.register(_Live(service))
        self._server = None

    def observe(self, cid: int, body, error_kind: str | None, nbytes_in: int, nbytes_out: int,
                run: tuple[str, float] | None) -> None:
        """One request served: its tenant's counters; ``run``: (engine, milliseconds) of a graph it ran."""
        tenancy = self.service.tenancy
        tenant = tenancy.name(cid) if tenancy is not None else ""
        kind = request_type(body) if body is not None else "malformed"
        self.requests.labels(tenant, kind).inc()
        if error_kind is not None:
            self.errors.labels(tenant, kind, error_kind).inc()
        self.received.labels(tenant).inc(nbytes_in)
        self.sent.labels(tenant).inc(nbytes_out)
        if run is not None:
            self.runs.labels(run[0]).observe(run[1] / 1e3)

    def serve(self, host: str, port: int) -> tuple[str, int]:
        """Serve ``/metrics`` over HTTP on a thread of its own; the address it listens on."""
        from prometheus_client import start_http_server

        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return server.server_address[:2]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` (loopback) for ``--metrics``; ValueError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--metrics takes HOST:PORT or PORT, got {text!r}") from None
    if not 0 <= number < 65536:
        raise ValueError(f"--metrics port {number} is out of range")
    return host or "127.0.0.1", number


class _Live:
    """Gauges read from the service and the worker when Prometheus scrapes."""

    def __init__(self, service) -> None:
        self.service = service

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        service, worker = self.service, self.service.worker
        sessions = GaugeMetricFamily("remotorch_sessions", "Live sessions, by tenant.", labels=["tenant"])
        for tenant, n in sorted(sessions_by_tenant(service).items()):
            sessions.add_metric([tenant], n)
        yield sessions
        yield GaugeMetricFamily("remotorch_connections", "Open authenticated connections.",
                                value=len(service._connections))
        yield GaugeMetricFamily("remotorch_values", "Tensors the worker keeps by handle, all sessions.",
                                value=worker.handles.count())
        memory = worker.memory()
        yield GaugeMetricFamily("remotorch_resident_bytes", "Bytes sessions hold (uploads, graphs, training state).",
                                value=memory["tensor_bytes"] + memory["graph_bytes"] + memory["state_bytes"])
        yield GaugeMetricFamily("remotorch_cached_bytes", "Bytes kept for re-use that no session holds.",
                                value=memory["cached_bytes"])
        yield GaugeMetricFamily("remotorch_host_memory_bytes", "Resident set of the worker process.",
                                value=rss())
        device = worker.device
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        yield GaugeMetricFamily("remotorch_device_memory_bytes", "Bytes allocated on the worker's CUDA device "
                                "(0 on a CPU worker).", value=allocated)
        stats = worker.disk.stats() if worker.disk is not None else {}
        for name in ("hits", "misses", "writes"):
            yield CounterMetricFamily(f"remotorch_disk_cache_{name}", f"Disk cache {name}.",
                                      value=stats.get(name, 0))
        yield GaugeMetricFamily("remotorch_disk_cache_bytes", "Bytes in the disk cache.", value=stats.get("bytes", 0))
        yield GaugeMetricFamily("remotorch_unacknowledged_requests", "Requests run whose replies their clients "
                                "have not acknowledged yet: how far ahead client queues run.",
                                value=service.replays.unacknowledged())
