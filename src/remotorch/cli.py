"""``remotorch`` command line: a thin layer over the library."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading


def _size(text: str) -> int:
    from .config import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _limits(args: argparse.Namespace):
    from .worker.quota import Limits

    given = {name: getattr(args, name) for name in ("max_tensor_bytes", "max_graph_bytes", "memory_quota",
                                                    "memory_limit", "cache_bytes", "request_timeout")
             if getattr(args, name) is not None}
    return Limits(**given)


def _tls(args: argparse.Namespace):
    if not args.tls_cert:
        return None
    from .transport.tls import server_context

    return server_context(args.tls_cert, args.tls_key)


class ServeError(ValueError):
    """``remotorch serve`` cannot start as configured (the message says why)."""


def make_server(args: argparse.Namespace, token: str | None = None):
    """The worker and its server that ``remotorch serve ARGS`` runs, listening but not yet serving.

    ``token`` overrides ``--token``/``REMOTORCH_TOKEN`` (a Ray actor passes
    its cluster's). ``ServeError`` when the configuration cannot serve: the
    rules ``remotorch serve`` enforces (no public bind without a token, TLS
    only over TCP…), a bad engine or device, a port that cannot be bound.
    Used by :func:`cmd_serve` and by :mod:`remotorch.cluster.actor`, so a
    worker in a Ray actor is configured exactly as one on the command line.
    """
    from .transport.listener import is_loopback
    from .worker.server import WorkerServer
    from .worker import Worker, engines
    from .config import from_env, parse_spin_us

    token = token or args.token or from_env().token
    if args.unix and args.tls_cert:
        raise ServeError("--tls-cert is for TCP; a --unix socket is reachable only on this host")
    try:
        spin_us = parse_spin_us(args.spin_us, "--spin-us")
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    if args.unix and not os.path.isabs(args.unix):
        raise ServeError(f"--unix needs an absolute path, got {args.unix!r}")
    if not args.unix and not is_loopback(args.host) and not token and not args.insecure:
        raise ServeError(f"refusing to listen on {args.host} without a token "
                         "(give --token or REMOTORCH_TOKEN, or --insecure to accept anyone who can reach the port)")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    disk = _disk_cache(args)
    try:
        from .worker.custom_ops import load_allowed

        allow_ops = load_allowed(args.allow_ops or (), args.imports or ())
        engine_names = [e for e in args.engines.split(",") if e] if args.engines else None
        worker = Worker(args.device, name=args.name, price_per_hour=args.price_per_hour,
                        engine_names=engine_names, limits=_limits(args), allow_ops=allow_ops,
                        group_host=args.group_host, disk=disk)
        engines.prewarm([e for e in (args.warm_engines or "").split(",") if e], worker.device)
        tls = _tls(args)
    except (ValueError, OSError) as exc:
        raise ServeError(str(exc)) from None
    try:
        return WorkerServer(worker, args.host, args.port, token, max_message_bytes=args.max_message_bytes,
                            lease_s=args.lease, tls=tls, message_timeout=args.message_timeout,
                            unix_path=args.unix, spin_s=None if spin_us is None else spin_us / 1e6,
                            peer_tls_ca=args.peer_tls_ca)
    except OSError as exc:
        raise ServeError(f"cannot listen: {exc}") from None


def _disk_cache(args: argparse.Namespace):
    """The worker's cache on disk (``--cache-dir``, else ``REMOTORCH_CACHE_DIR``), or None."""
    from .config import from_env
    from .worker.disk import open_for_worker

    folder = None if args.no_cache else (args.cache_dir or from_env().cache_dir)
    return open_for_worker(folder, int(args.cache_max_gb * (1 << 30))) if folder else None


def serve_args(argv: list[str]) -> argparse.Namespace:
    """``remotorch serve ARGV`` parsed as the command line parses it (``ServeError`` with argparse's words)."""
    import contextlib
    import io

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return build_parser().parse_args(["serve", *argv])
    except SystemExit:
        raise ServeError(said.getvalue().strip().splitlines()[-1] if said.getvalue().strip()
                         else f"cannot parse remotorch serve {' '.join(argv)}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from .client.embedded import READY_PREFIX

    try:
        server = make_server(args)
    except ServeError as exc:
        print(f"remotorch serve: {exc}", file=sys.stderr)
        return 2
    worker = server.worker
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    if args.exit_on_stdin_close:
        def watch() -> None:
            sys.stdin.read()
            server.shutdown()
        threading.Thread(target=watch, daemon=True).start()
    print(f"{READY_PREFIX}{server.url}", flush=True)
    allowed = f", custom operators: {', '.join(sorted(worker.allow_ops))}" if worker.allow_ops else ""
    print(f"remotorch: worker {worker.name!r} on {worker.device}, engines: {', '.join(worker.engines)}{allowed}",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from .errors import RemoteError
    from .client.session import Session

    with Session(args.url, token=args.token, connect_timeout=args.timeout, timeout=args.timeout,
                 retry_after=0.0, tls_ca=args.tls_ca) as session:
        try:
            info = session.health()
        except RemoteError as exc:
            print(f"unhealthy: {args.url}: {type(exc).__name__}: {exc}")
            return 1
    print(f"healthy: {args.url}")
    for key in ("name", "device", "torch_version", "engines", "allowed_ops", "protocol", "framing", "sessions",
                "price_per_hour"):
        value = info.get(key, [])
        if isinstance(value, list):
            value = ", ".join(value) or "none"
        print(f"  {key:14s} {value}")
    cache = info.get("disk_cache") or {}
    print(f"  {'disk_cache':14s} " + (f"{cache['dir']}, {cache['bytes']} bytes, {cache['hits']} hits, "
                                       f"{cache['writes']} writes {cache['problem']}" if cache else "none"))
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    from .errors import RemoteError
    from .client.session import Session

    urls = args.urls or None  # none: REMOTORCH_URL, else the embedded worker
    with Session(urls, token=args.token, connect_timeout=args.timeout, retry_after=0.0) as session:
        try:
            workers = session.workers()
        except RemoteError as exc:
            print(f"remotorch backends: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    from .profile.tables import is_terminal, table, write

    rows = [[f"{w['name']}/{engine}", str(w["device"]), f"{w['price_per_hour']:g}", w["url"] or "embedded"]
            for w in workers for engine in w["engines"]]
    term = is_terminal()
    write(table(("backend", "device", "$/hour", "worker url"), rows, indent=0, terminal=term), terminal=term)
    for w in workers:
        if w.get("allowed_ops"):
            print(f"{w['name']}: custom operators allowed: {', '.join(w['allowed_ops'])}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .profile.explain import run_explained

    try:
        explanations = run_explained(args.target, args.args)
    except Exception as exc:  # the user's program failed: say so, without our traceback around it
        print(f"remotorch explain: {args.target} raised {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if not explanations:
        print(f"remotorch explain: {args.target} called no @remotorch.accelerate function", file=sys.stderr)
        return 1
    for e in explanations:
        e.print()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .devtools.demo import run_demo

    return run_demo(engine=args.engine, device=args.device, repeats=args.repeats)


def _costs(text: str) -> float | list[float]:
    """A cost: one number for every stage, or comma-separated numbers, one per stage."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a cost: {text!r} (a number, or one per stage: 1,1.5,1)") from None
    return values[0] if len(values) == 1 else values


def cmd_schedule(args: argparse.Namespace) -> int:
    from .errors import ScheduleError
    from .pipeline import chart
    from .pipeline.simulate import simulate

    try:
        from .pipeline.builders import from_args

        schedule = from_args(args.name, file=args.file, stages=args.stages, microbatches=args.microbatches,
                             chunks=args.chunks, workers=args.workers)
        if args.text:
            print(schedule.text())
            return 0
        timeline = simulate(schedule, forward=args.forward, backward=args.backward, comm=args.comm)
    except (ScheduleError, OSError) as exc:
        where = f"{args.file}: " if args.file and not isinstance(exc, OSError) else ""
        print(f"remotorch schedule: {where}{exc}", file=sys.stderr)
        return 2
    width = args.width
    if width is None and sys.stdout.isatty():
        import shutil
        width = max(20, shutil.get_terminal_size().columns - len(f"w{schedule.workers - 1} "))
    print(chart.render(timeline, width=width or None))
    print()
    print(chart.figures(timeline))
    if args.png:
        try:
            chart.write_png(timeline, args.png)
        except (ImportError, OSError) as exc:
            print(f"remotorch schedule: cannot write {args.png}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.png}")
    return 0


def cmd_deploy_modal(args: argparse.Namespace) -> int:
    import time

    from .errors import RemoteError
    from .deploy.modal import ModalWorker, launch

    try:
        spec = ModalWorker(gpu=args.gpu or None, timeout=args.timeout, name=args.name, app_name=args.app_name,
                           port=args.port, price_per_hour=args.price_per_hour, volume=args.volume)
    except ValueError as exc:
        print(f"remotorch deploy modal: {exc}", file=sys.stderr)
        return 2
    cache = f", disk cache on Volume {spec.volume!r}" if spec.volume else ""
    print(f"starting a remotorch worker on Modal ({spec.gpu or 'CPU'}, up to {spec.timeout} s{cache})...",
          file=sys.stderr, flush=True)
    try:
        with launch(spec, show_output=args.logs) as d:
            print(f"remotorch: worker {d.name!r} on Modal {d.gpu or 'CPU'} at {d.url} "
                  f"(${spec.price:g}/hour); it stops in {spec.timeout} s or at Ctrl-C")
            print("connect with:")
            print(f"  export REMOTORCH_URL={d.url}")
            print(f"  export REMOTORCH_TOKEN={d.token}")
            print(f"  export REMOTORCH_TLS_CA={d.tls_ca}")
            print(f"or in Python: remotorch.Session({d.url!r}, token={d.token!r}, tls_ca={d.tls_ca!r})",
                  flush=True)
            while time.time() < d.expires_at:
                time.sleep(min(5.0, max(0.0, d.expires_at - time.time())))
    except KeyboardInterrupt:
        print("remotorch deploy modal: stopping the worker", file=sys.stderr)
    except (RemoteError, ImportError) as exc:
        print(f"remotorch deploy modal: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from .config import default_cache_dir, from_env
    from .worker.disk import CacheUnavailable, DiskCache, describe

    try:
        disk = DiskCache(args.cache_dir or from_env().cache_dir or str(default_cache_dir()), max_bytes=1 << 62)
    except CacheUnavailable as exc:
        print(f"remotorch cache: {exc.strerror}", file=sys.stderr)
        return 1
    for line in describe(disk, args.action):
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remotorch", description="Run PyTorch graphs on remote workers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a worker server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=7878, help="0 picks a free port")
    serve.add_argument("--group-host", default="127.0.0.1", metavar="ADDR",
                       help="the only address process groups with other workers (data parallelism) bind "
                            "to; torch.distributed authenticates nothing: name a private network "
                            "(default: loopback)")
    serve.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    serve.add_argument("--token", default=None, help="shared secret (default: $REMOTORCH_TOKEN)")
    serve.add_argument("--name", default="worker", help="the worker's name in reports")
    serve.add_argument("--threads", type=int, default=0,
                       help="CPU threads for graph kernels (default: torch's choice)")
    serve.add_argument("--unix", default=None, metavar="PATH",
                       help="listen on a Unix socket at PATH (clients on this host: unix://PATH) instead of TCP")
    serve.add_argument("--spin-us", default="auto", metavar="US",
                       help="after each request, busy-poll this many microseconds for the next one before "
                            "sleeping (lower latency for back-to-back calls, at the cost of a busy core); "
                            "'auto' (the default) polls up to 1000 while requests come back to back, on a "
                            "machine with more than one CPU; 0: never")
    serve.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without a token")
    serve.add_argument("--price-per-hour", type=float, default=0.0,
                       help="$ per hour of this worker, reported for cost estimates (default 0)")
    serve.add_argument("--engines", default=None,
                       help="comma-separated engines to offer, in order (default: all that load here); "
                            "debugging aids only by name: failing (refuses every graph), hold:SECONDS "
                            "(eager, then holds each answer that long)")
    serve.add_argument("--allow-ops", default=None, metavar="NS[,NS…]",
                       help="namespaces of library custom operators graphs may call, e.g. transformers,torchao "
                            "(imports the library that registers each well-known one; only operators "
                            "registered in this process run, never code from a client; see docs/security.md)")
    serve.add_argument("--import", dest="imports", default=None, metavar="MODULE[,MODULE…]",
                       help="modules to import at start-up that register custom operators "
                            "(for namespaces --allow-ops names that remotorch does not know)")
    serve.add_argument("--exit-on-stdin-close", action="store_true", help=argparse.SUPPRESS)
    serve.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve tls:// (encrypted)")
    serve.add_argument("--tls-key", default=None, help="PEM private key (if not in --tls-cert)")
    serve.add_argument("--peer-tls-ca", default=None,
                       help="CA certificate (PEM) to check tls:// workers this one sends tensors to "
                            "(default: the system's CAs)")
    serve.add_argument("--memory-quota", type=_size, default=None,
                       help="bytes one session may hold (weights, graphs), e.g. 4G; default: no quota")
    serve.add_argument("--memory-limit", type=_size, default=None,
                       help="bytes all sessions and the cache may hold together; default: no limit")
    serve.add_argument("--cache-bytes", type=_size, default=None,
                       help="bytes of objects no session holds kept for re-use, per kind (default 0: freed at once)")
    serve.add_argument("--cache-dir", default=None, metavar="DIR",
                       help="keep uploaded weights, graphs and compiled engine artifacts in DIR, so a restarted "
                            "worker serves them without a new upload (default: $REMOTORCH_CACHE_DIR, else none)")
    serve.add_argument("--warm-engines", default=None, metavar="E[,E…]", help="load these engines before serving "
                       "(inductor: the first graph of a restarted worker then loads from the disk cache in 0.2 s, not 3)")
    serve.add_argument("--no-cache", action="store_true", help="no disk cache, whatever the environment says")
    serve.add_argument("--cache-max-gb", type=float, default=20.0,
                       help="size of the disk cache; least recently used entries go first (default 20)")
    serve.add_argument("--max-message-bytes", type=_size, default=None,
                       help="largest request accepted (header and frames); default: no limit")
    serve.add_argument("--max-graph-bytes", type=_size, default=None,
                       help="largest graph document with its constants (default 256M)")
    serve.add_argument("--max-tensor-bytes", type=_size, default=None,
                       help="largest single tensor (default 64G)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds one graph may run before it is stopped; default: no limit")
    serve.add_argument("--message-timeout", type=float, default=60.0,
                       help="seconds a client may take to send the rest of a message it started (default 60)")
    serve.add_argument("--lease", type=float, default=30.0,
                       help="seconds a session outlives its connection or its last heartbeat (default 30)")
    serve.set_defaults(fn=cmd_serve)

    health = sub.add_parser("health", help="ask a worker whether it is up and what it offers")
    health.add_argument("url", help="tcp://host:port, tls://host:port or unix:///path")
    health.add_argument("--token", default=None)
    health.add_argument("--timeout", type=float, default=5.0)
    health.add_argument("--tls-ca", default=None, help="CA certificate (PEM) to check a tls:// worker against")
    health.set_defaults(fn=cmd_health)

    backends = sub.add_parser("backends", help="list the WORKER/ENGINE backends that workers offer")
    backends.add_argument("urls", nargs="*", help="tcp://host:port … (default: $REMOTORCH_URL or the embedded worker)")
    backends.add_argument("--token", default=None, help="token for every worker (default: $REMOTORCH_TOKEN)")
    backends.add_argument("--timeout", type=float, default=5.0)
    backends.set_defaults(fn=cmd_backends)

    explain = sub.add_parser("explain", help="show graphs and graph breaks of @accelerate functions")
    explain.add_argument("target", help="a script (path/to/script.py) or a callable (package.module:function)")
    explain.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    explain.set_defaults(fn=cmd_explain)

    sched = sub.add_parser("schedule", help="build or read a pipeline schedule, chart its simulated timeline",
                           description="Build a pipeline schedule (or read one written by hand with --file), "
                                       "validate it, simulate it and chart the timeline with its figures.")
    sched.add_argument("name", nargs="?", help="GPipe, 1F1B or Interleaved1F1B")
    sched.add_argument("--stages", type=int, default=None, help="model stages")
    sched.add_argument("--microbatches", type=int, default=None, help="microbatches per step")
    sched.add_argument("--chunks", type=int, default=1, help="stages per worker (default 1)")
    sched.add_argument("--workers", type=int, default=None, help="workers (default: stages / chunks); "
                       "stage s runs on worker s %% workers")
    sched.add_argument("--file", default=None, help="read a hand-written schedule: one line per worker, "
                       "actions like 0F1 (stage 0, forward, microbatch 1) and 1B0 separated by spaces")
    sched.add_argument("--forward", type=_costs, default=1.0, help="cost of a forward (or one per stage: 1,2,1)")
    sched.add_argument("--backward", type=_costs, default=2.0, help="cost of a backward (or one per stage)")
    sched.add_argument("--comm", type=float, default=0.0, help="cost of a hop between workers (default 0)")
    sched.add_argument("--width", type=int, default=None,
                       help="chart width in columns (default: the terminal's; unlimited when not a terminal)")
    sched.add_argument("--png", default=None, metavar="FILE", help="also draw the timeline as a PNG (matplotlib)")
    sched.add_argument("--text", action="store_true", help="print the schedule's text form instead")
    sched.set_defaults(fn=cmd_schedule)
    deploy = sub.add_parser("deploy", help="start a worker on a cloud platform")
    platforms = deploy.add_subparsers(dest="platform", required=True)
    modal = platforms.add_parser("modal", help="a worker in a Modal GPU container, over TLS with a random token")
    modal.add_argument("--gpu", default="H100", help="Modal GPU type, e.g. T4, L4, A10G, A100, H100, H100:2 "
                                                    "('' for a CPU container; default H100)")
    modal.add_argument("--timeout", type=int, default=3600, help="seconds until the worker stops (default 3600)")
    modal.add_argument("--name", default="modal", help="the worker's name in reports (default modal)")
    modal.add_argument("--app-name", default="remotorch", help="the Modal app's name (default remotorch)")
    modal.add_argument("--port", type=int, default=7878, help="the worker's port inside the container")
    modal.add_argument("--price-per-hour", type=float, default=None,
                       help="$ per hour reported to profiles (default: Modal's list price for the GPU)")
    modal.add_argument("--volume", default=None, metavar="NAME",
                       help="keep the worker's disk cache on this modal.Volume (created if missing): the next run "
                            "with the same Volume starts warm (default: no disk cache)")
    modal.add_argument("--logs", action="store_true", help="show Modal's image build and container logs")
    modal.set_defaults(fn=cmd_deploy_modal)

    cache = sub.add_parser("cache", help="list, measure or clear a worker's disk cache")
    cache.add_argument("action", choices=("ls", "du", "clear"))
    cache.add_argument("--cache-dir", default=None, metavar="DIR",
                       help="the cache folder (default: $REMOTORCH_CACHE_DIR, else the embedded worker's)")
    cache.set_defaults(fn=cmd_cache)

    demo = sub.add_parser("demo", help="run example models on the embedded worker")
    demo.add_argument("--engine", default="eager")
    demo.add_argument("--device", default="auto")
    demo.add_argument("--repeats", type=int, default=50)
    demo.set_defaults(fn=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.fn(args)
