"""``remotorch`` command line: a thin layer over the library."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    from .server import WorkerServer
    from .worker import Worker
    from .embedded import READY_PREFIX

    token = args.token or os.environ.get("REMOTORCH_TOKEN") or None
    if not _is_loopback(args.host) and not token and not args.insecure:
        print(f"remotorch serve: refusing to listen on {args.host} without a token "
              "(give --token or REMOTORCH_TOKEN, or --insecure to accept anyone who can reach the port)",
              file=sys.stderr)
        return 2
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    try:
        engine_names = [e for e in args.engines.split(",") if e] if args.engines else None
        worker = Worker(args.device, name=args.name, price_per_hour=args.price_per_hour,
                        engine_names=engine_names)
    except ValueError as exc:
        print(f"remotorch serve: {exc}", file=sys.stderr)
        return 2
    server = WorkerServer(worker, args.host, args.port, token)
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    if args.exit_on_stdin_close:
        def watch() -> None:
            sys.stdin.read()
            server.shutdown()
        threading.Thread(target=watch, daemon=True).start()
    print(f"{READY_PREFIX}{server.url}", flush=True)
    print(f"remotorch: worker {worker.name!r} on {worker.device}, engines: {', '.join(worker.engines)}",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from .errors import RemoteError
    from .session import Session

    with Session(args.url, token=args.token, connect_timeout=args.timeout, timeout=args.timeout,
                 retry_after=0.0) as session:
        try:
            info = session.health()
        except RemoteError as exc:
            print(f"unhealthy: {args.url}: {type(exc).__name__}: {exc}")
            return 1
    print(f"healthy: {args.url}")
    for key in ("name", "device", "torch_version", "engines", "protocol", "sessions", "price_per_hour"):
        value = info[key]
        print(f"  {key:14s} {', '.join(value) if isinstance(value, list) else value}")
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    from .errors import RemoteError
    from .session import Session

    urls = args.urls or None  # none: REMOTORCH_URL, else the embedded worker
    with Session(urls, token=args.token, connect_timeout=args.timeout, retry_after=0.0) as session:
        try:
            workers = session.workers()
        except RemoteError as exc:
            print(f"remotorch backends: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        for w in workers:
            print(f"{w['name']}  {w['url']}  device={w['device']}  ${w['price_per_hour']:g}/hour")
            for engine in w["engines"]:
                print(f"  {w['name']}/{engine}")
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
    from .demo import run_demo

    return run_demo(engine=args.engine, device=args.device, repeats=args.repeats)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remotorch", description="Run PyTorch graphs on remote workers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a worker server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=7878, help="0 picks a free port")
    serve.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    serve.add_argument("--token", default=None, help="shared secret (default: $REMOTORCH_TOKEN)")
    serve.add_argument("--name", default="worker", help="the worker's name in reports")
    serve.add_argument("--threads", type=int, default=0,
                       help="CPU threads for graph kernels (default: torch's choice)")
    serve.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without a token")
    serve.add_argument("--price-per-hour", type=float, default=0.0,
                       help="$ per hour of this worker, reported for cost estimates (default 0)")
    serve.add_argument("--engines", default=None,
                       help="comma-separated engines to offer, in order (default: all that load here)")
    serve.add_argument("--exit-on-stdin-close", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(fn=cmd_serve)

    health = sub.add_parser("health", help="ask a worker whether it is up and what it offers")
    health.add_argument("url", help="tcp://host:port")
    health.add_argument("--token", default=None)
    health.add_argument("--timeout", type=float, default=5.0)
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
