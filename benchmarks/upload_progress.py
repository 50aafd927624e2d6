"""What an upload's progress bar costs: the same upload with and without a bar, measured in one run.

Against a real ``remotorch serve`` worker on loopback (spawned here), 256 MiB
of weights (eight 32 MiB tensors, fresh each round so every round uploads)
go up through ``Connection.uploads.upload`` (a fresh session each time): once with no bar (what pipes and CI
get), once with the bar forced on and drawn into an in-memory "terminal"
(what a user at a terminal gets: rich's renderer and its refresh thread,
the per-piece callback). Rounds alternate which goes first; medians are
compared. On a shared, loaded machine that end-to-end ratio swings both ways
by tens of percent, so the bar's own cost is also measured alone, in this
process: a bar started, advanced once per 256 KiB piece of the same upload,
and stopped, drawn into the same kind of in-memory terminal.

Target: the bar's own cost (median) at most 5% of the median upload without
a bar. The end-to-end ratio is printed beside it.
Exit code 0 when the target is met, else 1.

Usage::

    python benchmarks/upload_progress.py [--rounds 7] [--mib 256]
"""

from __future__ import annotations

import argparse
import io
import secrets
import statistics
import sys
import time
from functools import partial

import torch

import remotorch
from remotorch.client.embedded import spawn_worker
from remotorch.client.progress import upload_bar


class Terminal(io.StringIO):
    """A stream that says it is a terminal (rich draws into it as into one)."""

    def isatty(self) -> bool:
        return True


def upload_ms(session: remotorch.Session, tensors: dict[str, torch.Tensor], with_bar: bool) -> tuple[float, int]:
    conn = session.connection
    screen = Terminal()
    conn.upload_progress = partial(upload_bar, enabled=True, stream=screen) if with_bar else None
    start = time.perf_counter()
    conn.uploads.upload(tensors)
    return (time.perf_counter() - start) * 1e3, len(screen.getvalue())


def bar_cost_ms(nbytes: int, piece: int = 256 << 10) -> float:
    """A bar for ``nbytes``: started, advanced once per piece, stopped; milliseconds, nothing uploaded."""
    start = time.perf_counter()
    with upload_bar("uploading", nbytes, enabled=True, stream=Terminal()) as advance:
        for _ in range(nbytes // piece):
            advance(piece)
    return (time.perf_counter() - start) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    token = secrets.token_hex(16)
    worker = spawn_worker(["--host", "127.0.0.1", "--port", "0", "--token", token, "--name", "bench"])
    times: dict[bool, list[float]] = {False: [], True: []}
    drawn = 0
    try:
        n = max(1, args.mib // 32)
        for r in range(args.rounds):
            for with_bar in ((False, True) if r % 2 == 0 else (True, False)):
                # a session per upload: what it stored is freed when it closes
                with remotorch.Session(worker.url, token=token, progress=False) as session:
                    session.health()
                    fresh = [torch.randn(8 << 20) for _ in range(n)]
                    tensors = {session.ids.get(t)[0]: t for t in fresh}  # stored under their content ids
                    ms, chars = upload_ms(session, tensors, with_bar)
                times[with_bar].append(ms)
                drawn += chars
    finally:
        worker.stop()
    plain, bar = statistics.median(times[False]), statistics.median(times[True])
    ratio = bar / plain
    mib = max(1, args.mib // 32) * 32
    own = statistics.median(bar_cost_ms(mib << 20) for _ in range(args.rounds))
    print(f"upload of {mib} MiB to a loopback worker, median of {args.rounds} rounds (alternating order):")
    print(f"  no bar:   {plain:8.1f} ms  ({mib / plain * 1e3:.0f} MiB/s)")
    print(f"  with bar: {bar:8.1f} ms  ({mib / bar * 1e3:.0f} MiB/s); {drawn} characters drawn")
    print(f"  ratio with/without: {ratio:.3f} (end to end; noisy where other work shares the cores)")
    print(f"  the bar alone: {own:.1f} ms = {own / plain:.3f} of the upload without it (target <= 0.05)")
    ok = own / plain <= 0.05 and drawn > 0
    print("target met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
