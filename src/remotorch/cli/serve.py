"""``remotorch serve``: its options, the worker and server they make, and the command.

:func:`make_server` is also how a Ray actor starts its worker
(:mod:`remotorch.cluster.actor`), so a worker there is configured exactly as
one on the command line.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading


def _size(text: str) -> int:
    from ..config import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _limits(args: argparse.Namespace):
    from ..worker.quota import Limits

    given = {name: getattr(args, name) for name in ("max_tensor_bytes", "max_graph_bytes", "memory_quota",
                                                    "memory_limit", "cache_bytes", "request_timeout")
             if getattr(args, name) is not None}
    return Limits(**given)


def _tls(args: argparse.Namespace):
    if not args.tls_cert:
        return None
    from ..transport.tls import server_context

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
    from ..transport.listener import is_loopback
    from ..worker.server import WorkerServer
    from ..worker import Worker, engines
    from ..config import from_env, parse_spin_us

    explicit = token or args.token
    token = explicit or from_env().token
    if args.unix and args.tls_cert:
        raise ServeError("--tls-cert is for TCP; a --unix socket is reachable only on this host")
    try:
        spin_us = parse_spin_us(args.spin_us, "--spin-us")
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    if args.unix and not os.path.isabs(args.unix):
        raise ServeError(f"--unix needs an absolute path, got {args.unix!r}")
    if not args.unix and not is_loopback(args.host) and not token and not args.tokens and not args.insecure:
        raise ServeError(f"refusing to listen on {args.host} without a token "
                         "(give --token, --tokens or REMOTORCH_TOKEN, or --insecure to accept anyone who can "
                         "reach the port)")
    metrics = None
    if args.metrics:
        from ..worker.metrics import parse_address

        try:
            metrics = parse_address(args.metrics)
        except ValueError as exc:
            raise ServeError(str(exc)) from None
    tenants = None
    if args.tokens:
        from ..worker.tenants import Tenants

        try:
            tenants = Tenants(args.tokens, explicit)  # (with a tokens file, the environment's token is not one)
        except ValueError as exc:
            raise ServeError(str(exc)) from None
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    from ..worker.hostmem import HostMemory

    disk = _disk_cache(args)
    try:
        from ..worker.custom_ops import load_allowed

        allow_ops = load_allowed(args.allow_ops or (), args.imports or ())
        engine_names = [e for e in args.engines.split(",") if e] if args.engines else None
        worker = Worker(args.device, name=args.name, price_per_hour=args.price_per_hour,
                        engine_names=engine_names, limits=_limits(args), allow_ops=allow_ops,
                        group_host=args.group_host, disk=disk, cuda_graphs=args.cuda_graphs,
                        roots=_roots(args))
        engines.prewarm([e for e in (args.warm_engines or "").split(",") if e], worker.device)
        tls = _tls(args)
        host_memory = HostMemory(tune=args.host_malloc == "tuned" and worker.device.type == "cpu")
    except (ValueError, OSError) as exc:
        raise ServeError(str(exc)) from None
    try:
        return WorkerServer(worker, args.host, args.port, token, max_message_bytes=args.max_message_bytes,
                            lease_s=args.lease, tls=tls, message_timeout=args.message_timeout,
                            unix_path=args.unix, spin_s=None if spin_us is None else spin_us / 1e6,
                            peer_tls_ca=args.peer_tls_ca, tenants=tenants, metrics=metrics,
                            host_memory=host_memory)
    except ValueError as exc:  # (--metrics without prometheus_client)
        raise ServeError(str(exc)) from None
    except OSError as exc:
        raise ServeError(f"cannot listen: {exc}") from None


def _roots(args: argparse.Namespace):
    """The folders ``--weights`` (read only) and ``--checkpoints`` (read and write) name."""
    from ..worker.roots import Roots, parse_root

    return Roots([parse_root(spec, False) for spec in args.weights or ()] +
                 [parse_root(spec, True) for spec in args.checkpoints or ()])


def _disk_cache(args: argparse.Namespace):
    """The worker's cache on disk (``--cache-dir``, else ``REMOTORCH_CACHE_DIR``), or None."""
    from ..config import from_env
    from ..worker.disk import open_for_worker

    folder = None if args.no_cache else (args.cache_dir or from_env().cache_dir)
    return open_for_worker(folder, int(args.cache_max_gb * (1 << 30))) if folder else None


def serve_args(argv: list[str]) -> argparse.Namespace:
    """``remotorch serve ARGV`` parsed as the command line parses it (``ServeError`` with argparse's words)."""
    import contextlib
    import io

    parser = argparse.ArgumentParser(prog="remotorch")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return parser.parse_args(["serve", *argv])
    except SystemExit:
        raise ServeError(said.getvalue().strip().splitlines()[-1] if said.getvalue().strip()
                         else f"cannot parse remotorch serve {' '.join(argv)}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from ..client.embedded import READY_PREFIX

    try:
        server = make_server(args)
    except ServeError as exc:
        print(f"remotorch serve: {exc}", file=sys.stderr)
        return 2
    worker = server.worker
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    if args.tokens and hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: server.reload_tokens())
    if args.exit_on_stdin_close:
        def watch() -> None:
            sys.stdin.read()
            server.shutdown()
        threading.Thread(target=watch, daemon=True).start()
    print(f"{READY_PREFIX}{server.url}", flush=True)
    allowed = f", custom operators: {', '.join(sorted(worker.allow_ops))}" if worker.allow_ops else ""
    lines = [f"worker {worker.name!r} on {worker.device}, engines: {', '.join(worker.engines)}{allowed}"]
    if server.metrics_address is not None:
        lines.append("metrics at http://{}:{}/metrics".format(*server.metrics_address))
    for line in lines:  # (a JSON log says it as records)
        if args.log_format == "json":
            logging.getLogger("remotorch.serve").info(line)
        else:
            print(f"remotorch: {line}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # Ctrl-C: stop as SIGTERM does, with the status of an interrupted command
        server.shutdown()
        return 130
    return 0


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """The ``serve`` subcommand and its options, on ``sub`` (the command line's subparsers)."""
    serve = sub.add_parser("serve", help="run a worker server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=7878, help="0 picks a free port")
    serve.add_argument("--group-host", default="127.0.0.1", metavar="ADDR",
                       help="the only address process groups with other workers (data parallelism) bind "
                            "to; torch.distributed authenticates nothing: name a private network "
                            "(default: loopback)")
    serve.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    serve.add_argument("--token", default=None, help="shared secret (default: $REMOTORCH_TOKEN)")
    serve.add_argument("--tokens", default=None, metavar="FILE",
                       help="named tokens, one TOML table per tenant ([tenants.NAME] token_sha256, and optional "
                            "memory_quota, max_sessions, requests_per_second, allow_ops); stored as hashes only; "
                            "SIGHUP reads it again (a removed token's sessions end); see docs/security.md")
    serve.add_argument("--name", default="worker", help="the worker's name in reports")
    serve.add_argument("--log-format", choices=("text", "json"), default="text",
                       help="text (the default, human-readable) or json: one JSON object per line, with a "
                            "record per request (tenant, session, type, duration, outcome); never tokens or "
                            "tensor bytes")
    serve.add_argument("--metrics", default=None, metavar="[HOST:]PORT",
                       help="serve Prometheus metrics at http://HOST:PORT/metrics (HOST defaults to 127.0.0.1; "
                            "port 0 picks one, printed at start-up); needs prometheus_client")
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
    serve.add_argument("--weights", action="append", metavar="NAME=DIR",
                       help="a folder of weights clients may load by name (NAME/relative/path: safetensors "
                            "files, save_pretrained folders, or a Hugging Face hub cache's org/repo); read "
                            "only; may be repeated. With none, every load is refused (see docs/security.md)")
    serve.add_argument("--checkpoints", action="append", metavar="NAME=DIR",
                       help="a folder clients may save checkpoints into (and load them from) by name; may "
                            "be repeated")
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
    serve.add_argument("--cuda-graphs", action="store_true", help="record each graph as a CUDA graph on its second "
                       "run and replay it (graphs it cannot record run as usual, counted in Stats)")
    serve.add_argument("--host-malloc", choices=("tuned", "default"), default="tuned",
                       help="tuned (default): a CPU worker keeps freed tensor buffers of up to 32 MiB for the "
                            "next ones and gives them back after 2 s idle (glibc; glibc's own MALLOC_* "
                            "variables win); default: the C library's own thresholds")
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
    return serve
