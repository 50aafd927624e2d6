"""``remotorch top URL …``: a live view of one or more workers, from their ``Stats`` replies.

Refreshed every ``--interval`` seconds (1 by default): per worker its
requests per second, connections and memory; per tenant its sessions,
requests per second and errors; the slowest graphs; the last errors. On a
terminal the screen is redrawn in place (``rich``); anywhere else each
refresh is printed as plain text. Ctrl-C ends it cleanly; ``--count N``
ends it after N refreshes. Asking needs an operator's token (``--token``, or
a tenant with ``operator = true``).
"""

from __future__ import annotations

import argparse
import sys
import time


def add_top_parser(sub) -> argparse.ArgumentParser:
    top = sub.add_parser("top", help="a live view of workers: tenants, memory, requests per second, "
                                     "slowest graphs, errors")
    top.add_argument("urls", nargs="*", help="tcp://host:port … (default: $REMOTORCH_URL)")
    top.add_argument("--token", default=None, help="an operator's token (default: $REMOTORCH_TOKEN)")
    top.add_argument("--tls-ca", default=None, help="CA certificate (PEM) to check tls:// workers against")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    top.add_argument("--count", type=int, default=0, help="refresh this many times, then exit (default: until Ctrl-C)")
    top.set_defaults(fn=cmd_top)
    return top


def cmd_top(args: argparse.Namespace) -> int:
    from ..client.probe import Probe
    from ..config import from_env
    from ..profile.tables import is_terminal

    env = from_env()
    urls = args.urls or ([env.url] if env.url else [])
    if not urls:
        print("remotorch top: name a worker (tcp://host:port), or set REMOTORCH_URL", file=sys.stderr)
        return 2
    token = args.token or env.token
    try:
        probes = {url: Probe(url, token, tls_ca=args.tls_ca or env.tls_ca, connect_timeout=5.0, timeout=10.0)
                  for url in urls}
    except ValueError as exc:  # not an address
        print(f"remotorch top: {exc}", file=sys.stderr)
        return 2
    terminal = is_terminal()
    previous: dict[str, tuple[float, object]] = {}
    try:
        if terminal:
            from rich.live import Live

            from rich.console import Group

            with Live(Group(*_screen(_poll(probes, previous), terminal=True)), auto_refresh=False,
                      screen=False) as live:
                for _ in _ticks(args):
                    live.update(Group(*_screen(_poll(probes, previous), terminal=True)), refresh=True)
        else:
            from ..profile.tables import write

            write(*_screen(_poll(probes, previous), terminal=False), terminal=False)
            for _ in _ticks(args):
                write(*_screen(_poll(probes, previous), terminal=False), terminal=False)
    except KeyboardInterrupt:
        pass
    finally:
        for probe in probes.values():
            probe.close()
    return 0


def _ticks(args):
    n = 1
    while not args.count or n < args.count:
        time.sleep(max(args.interval, 0.05))
        n += 1
        yield n


def _poll(probes, previous) -> list[tuple[str, object, dict]]:
    """Each worker's reply (or the error asking it), with rates since the last poll."""
    from ..codec import messages as m
    from ..errors import RemoteError

    out = []
    for url, probe in probes.items():
        now = time.monotonic()
        try:
            reply = probe.ask(m.Stats(), m.StatsReply)
        except RemoteError as exc:
            out.append((url, exc, {}))
            continue
        rates = {}
        last = previous.get(url)
        if last is not None and now > last[0]:
            dt, before = now - last[0], last[1]
            rates[""] = (reply.requests - before.requests) / dt
            old = {t.name: t.requests for t in before.tenants}
            for t in reply.tenants:
                rates[t.name] = (t.requests - old.get(t.name, 0)) / dt
        previous[url] = (now, reply)
        out.append((url, reply, rates))
    return out


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _screen(polled, *, terminal: bool) -> list:
    """What one refresh shows: a line and tables per worker."""
    from ..profile.tables import table

    parts: list = []
    for url, reply, rates in polled:
        if isinstance(reply, Exception):
            parts.append(f"{url}: {type(reply).__name__}: {reply}")
            continue
        rps = f"{rates[''] :.1f}" if "" in rates else "-"
        device = f", device {_size(reply.device_memory_bytes)} of {_size(reply.device_memory_total)}" \
            if reply.device_memory_total else ""
        parts.append(f"{reply.name} ({url}) on {reply.device}: up {reply.uptime_s:.0f} s, {rps} requests/s, "
                     f"{reply.requests} requests, {reply.errors} errors, {reply.connections} connections; "
                     f"memory: resident {_size(reply.resident_bytes)}, cached {_size(reply.cached_bytes)}, "
                     f"host {_size(reply.host_memory_bytes)}{device}")
        parts.append(table(("tenant", "sessions", "requests/s", "requests", "errors"),
                           [[t.name or "(token)", str(t.sessions),
                             f"{rates[t.name]:.1f}" if t.name in rates else "-", str(t.requests), str(t.errors)]
                            for t in reply.tenants], terminal=terminal, title="tenants"))
        if reply.slowest:
            parts.append(table(("graph", "engine", "tenant", "runs", "mean ms", "max ms"),
                               [[g.graph, g.engine, g.tenant or "(token)", str(g.runs), f"{g.mean_ms:.2f}",
                                 f"{g.max_ms:.2f}"] for g in reply.slowest], terminal=terminal,
                               title="slowest graphs"))
        if reply.recent_errors:
            parts.append(table(("at s", "tenant", "request", "kind", "message"),
                               [[f"{e.at_s:.1f}", e.tenant or "(token)", e.request, e.kind, e.message[:100]]
                                for e in reply.recent_errors[-8:]], terminal=terminal, title="recent errors"))
    return parts
