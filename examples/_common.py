"""Command-line options shared by the profiling examples."""

from __future__ import annotations

import argparse

import remotorch


def parse_args(description: str, default_backends: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", action="append", default=[],
                        help="worker tcp://host:port (repeat for several; default: $REMOTORCH_URL or an embedded worker)")
    parser.add_argument("--token", default=None, help="token for the workers (default: $REMOTORCH_TOKEN)")
    parser.add_argument("--backends", default=",".join(default_backends or []),
                        help="comma-separated WORKER/ENGINE list (default: every engine of every worker)")
    parser.add_argument("--calls", type=int, default=5, help="calls of the profiled function")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per graph and call")
    parser.add_argument("--out", default=None, help="folder for profile.json, profile.csv, profile.png")
    return parser.parse_args()


def session_for(args: argparse.Namespace) -> remotorch.Session:
    return remotorch.Session(args.url or None, token=args.token)


def backends_for(args: argparse.Namespace, session: remotorch.Session) -> list[str] | None:
    """The requested backends; names without a worker (``onnxrt``) mean that engine on the first worker."""
    if not args.backends:
        return None
    first = session.connections()[0].name
    return [b if "/" in b else f"{first}/{b}" for b in args.backends.split(",") if b]


def finish(report, args: argparse.Namespace) -> None:
    report.print()
    if args.out:
        paths = report.save(args.out)
        print("\nsaved: " + ", ".join(str(p) for p in paths.values()))
