"""``remotorch`` command line: a thin layer over the library (``serve`` in :mod:`remotorch.cli.serve`)."""

from __future__ import annotations

import argparse
import sys

from .serve import ServeError, _size, add_serve_parser, cmd_serve, make_server, serve_args  # noqa: F401
from .top import add_top_parser


def cmd_health(args: argparse.Namespace) -> int:
    from ..client.probe import Probe
    from ..config import from_env
    from ..errors import RemoteError

    env = from_env()
    token = args.token if args.token is not None else env.token
    try:
        with Probe(args.url, token, timeout=args.timeout, connect_timeout=args.timeout,
                   tls_ca=args.tls_ca or env.tls_ca) as probe:
            info = probe.health()
    except ValueError as exc:  # not an address
        print(f"remotorch health: {exc}", file=sys.stderr)
        return 2
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
    from ..errors import RemoteError
    from ..client.session import Session

    urls = args.urls or None  # none: REMOTORCH_URL, else the embedded worker
    with Session(urls, token=args.token, connect_timeout=args.timeout, retry_after=0.0) as session:
        try:
            workers = session.workers()
        except RemoteError as exc:
            print(f"remotorch backends: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    from ..profile.tables import is_terminal, table, write

    rows = [[f"{w['name']}/{engine}", str(w["device"]), f"{w['price_per_hour']:g}", w["url"] or "embedded"]
            for w in workers for engine in w["engines"]]
    term = is_terminal()
    write(table(("backend", "device", "$/hour", "worker url"), rows, indent=0, terminal=term), terminal=term)
    for w in workers:
        if w.get("allowed_ops"):
            print(f"{w['name']}: custom operators allowed: {', '.join(w['allowed_ops'])}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from ..profile.explain import run_explained

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
    from ..devtools.demo import run_demo

    return run_demo(engine=args.engine, device=args.device, repeats=args.repeats)


def _costs(text: str) -> float | list[float]:
    """A cost: one number for every stage, or comma-separated numbers, one per stage."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a cost: {text!r} (a number, or one per stage: 1,1.5,1)") from None
    return values[0] if len(values) == 1 else values


def cmd_schedule(args: argparse.Namespace) -> int:
    from ..errors import ScheduleError
    from ..pipeline import chart
    from ..pipeline.simulate import simulate

    try:
        from ..pipeline.builders import from_args

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

    from ..errors import RemoteError
    from ..deploy.modal import ModalWorker, launch

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
    import time
    from pathlib import Path

    from ..codec import cachedir
    from ..config import default_cache_dir, from_env

    root = Path(args.cache_dir or from_env().cache_dir or str(default_cache_dir())).expanduser().resolve()
    try:
        if args.action == "clear":
            print(f"cleared {root}: {_mib(cachedir.clear(root))} freed")
        elif args.action == "du":
            usage = cachedir.usage(root)
            for part, n in [*usage.items(), (str(root), sum(usage.values()))]:
                print(f"{_mib(n):>12}  {part}")
        else:
            for e in sorted(cachedir.entries(root), key=lambda e: -e.used):
                print(f"{e.kind:18s} {e.key[:16]}  {_mib(e.nbytes):>12}  "
                      f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(e.used))}")
    except OSError as exc:
        print(f"remotorch cache: {root}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes < 1 << 30 else f"{nbytes / (1 << 30):.2f} GiB"


def cmd_token_new(args: argparse.Namespace) -> int:
    import secrets

    from ..config import TENANT_NAME
    from ..transport.handshake import token_hash

    if not TENANT_NAME.fullmatch(args.name):
        print("remotorch token new: a name is 1 to 64 characters of [A-Za-z0-9_.-]", file=sys.stderr)
        return 2
    token = "rmt_" + secrets.token_urlsafe(32)
    print(token)
    print(f"# add to the worker's --tokens file (the token above is shown once; only its hash is kept):\n"
          f"[tenants.{args.name}]\ntoken_sha256 = \"{token_hash(token).hex()}\"\n"
          f"# memory_quota = \"2G\"\n# max_sessions = 4\n# requests_per_second = 200\n"
          f"# allow_ops = [\"transformers\"]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remotorch", description="Run PyTorch graphs on remote workers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    add_serve_parser(sub)

    add_top_parser(sub)

    token = sub.add_parser("token", help="make tokens for a worker's --tokens file")
    token_sub = token.add_subparsers(dest="action", required=True)
    new = token_sub.add_parser("new", help="print a new token, then the TOML table that admits it")
    new.add_argument("name", help="the tenant's name (1 to 64 of A-Z a-z 0-9 _ . -)")
    new.set_defaults(fn=cmd_token_new)

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
    """Run ``remotorch ARGV``; its exit status. Ctrl-C at any moment (a slow import included) ends it
    without a traceback: status 130, as a shell reports an interrupted command, or 0 for ``top``,
    whose normal way to stop it is."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        _configure_logging(args)
        return args.fn(args)
    except KeyboardInterrupt:
        return 0 if [a for a in argv if not a.startswith("-")][:1] == ["top"] else 130


def _configure_logging(args: argparse.Namespace) -> None:
    """Log warnings (debug messages with ``-v``) to stderr; ``serve --log-format json`` as JSON records."""
    if getattr(args, "log_format", "text") == "json":
        from ..worker.logs import configure_json  # (serve: the worker is imported anyway)

        configure_json(args.verbose)
    else:
        import logging

        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
