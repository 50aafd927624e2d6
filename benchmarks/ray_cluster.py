"""What running remotorch workers inside Ray actors costs: start time and per-call overhead, in one run.

Measured against plain ``remotorch serve`` processes started on this machine
in the same run (configured from the same ``remotorch serve`` arguments the actors use):

1. Start: two plain workers started at once (until both print their ready
   line) vs ``RayCluster(2)`` entered with no Ray running ("cold": it starts
   a local Ray, then the actors and their workers) and with Ray running
   ("warm": actors and workers only); and ``cluster.restart(i)``, one
   worker's actor killed and a fresh one serving. An actor's memory (RSS;
   the actor process is the worker) is printed beside a plain worker's.
2. Per call: a 64-byte echo and a warm call of a compiled 256x256 linear
   layer, through ``cluster.session`` and through a session to a plain
   worker, measured in alternating blocks so that both see the same load
   (the call's output read each time: a call is sent without waiting, and
   only the read waits for the worker).
   Ray is not on the call path (the client talks remotorch's protocol to
   the worker directly), so the ratios should be 1.

Targets (exit 1 when missed): median per-call time through the cluster at
most 1.25x the plain worker's for both calls; warm cluster start at most
2x the plain start.

Ray runs loopback-only here (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, set
before Ray is imported, unless set already) with token authentication on
(a random ``RAY_AUTH_TOKEN`` unless one is set), and no dashboard.

Usage::

    python benchmarks/ray_cluster.py [--calls 400] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

import torch  # noqa: E402

import remotorch  # noqa: E402
from remotorch.client.embedded import spawn_worker  # noqa: E402
from remotorch.cluster import RayCluster  # noqa: E402

RAY_INIT = dict(num_cpus=4, object_store_memory=150 << 20, log_to_driver=False)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start_plain(n: int, token: str) -> tuple[float, list]:
    """Start ``n`` plain workers at once; seconds until all serve, and the processes."""
    env = dict(os.environ, REMOTORCH_TOKEN=token, PYTHONUNBUFFERED="1")
    workers: list = [None] * n
    t0 = time.perf_counter()

    def one(i: int) -> None:
        workers[i] = spawn_worker(["--host", "127.0.0.1", "--port", "0", "--name", f"plain-{i}", "--device", "cpu",
                                   "--threads", "1"], env=env)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, workers


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def read(out: torch.Tensor) -> torch.Tensor:
    """``out`` with its data here: a call returns a placeholder at once, and only a read waits."""
    materialize = getattr(out, "materialize_", None)
    return materialize() if materialize is not None else out


def per_call(cluster_session, plain_session, calls: int) -> dict:
    """Median microseconds per call of an echo and of a compiled linear layer, cluster vs plain."""
    layer = torch.nn.Linear(256, 256).eval()
    x = torch.randn(8, 256)
    payload = [bytes(64)]
    runs = {}
    for name, s in (("cluster", cluster_session), ("plain", plain_session)):
        f = remotorch.compile(layer, session=s, fallback="raise")
        with torch.no_grad():
            assert torch.allclose(f(x), layer(x), atol=1e-5)
        runs[name] = dict(echo=lambda s=s: s.echo(payload), call=lambda f=f: read(f(x)), echo_s=[], call_s=[])
    block = 50
    with torch.no_grad():
        for _ in range(max(1, calls // block)):
            for name in ("cluster", "plain"):
                r = runs[name]
                r["echo_s"] += timed(r["echo"], block)
                r["call_s"] += timed(r["call"], block)
    med = {name: {k: statistics.median(r[f"{k}_s"]) * 1e6 for k in ("echo", "call")} for name, r in runs.items()}
    stats = cluster_session.stats()
    assert stats["fallbacks"] == 0 and stats["remote_calls"] >= calls, stats
    return med


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    token = secrets.token_hex(16)
    torch.set_num_threads(1)

    plain_s, plain = start_plain(2, token)
    t0 = time.perf_counter()
    cluster = RayCluster(2, num_cpus_per_worker=1, ray_init_kwargs=RAY_INIT).start()
    cold_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        with RayCluster(2, num_cpus_per_worker=1):
            warm_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cluster.restart(1)
        restart_s = time.perf_counter() - t0
        info = cluster.workers[0]
        actor_mb, plain_mb = rss_mb(info["pid"]), rss_mb(plain[0].pid)
        with remotorch.Session(plain[0].url, token=token) as plain_session:
            med = per_call(cluster.session, plain_session, args.calls)
    finally:
        t0 = time.perf_counter()
        cluster.close()
        close_s = time.perf_counter() - t0
        for w in plain:
            w.stop()

    print("remotorch workers on Ray vs plain `remotorch serve` (this machine, one run)")
    print(f"  start, 2 workers: plain {plain_s:6.2f} s | cluster, Ray running {warm_s:6.2f} s "
          f"({warm_s / plain_s:.2f}x) | cluster, starting Ray too {cold_s:6.2f} s ({cold_s / plain_s:.2f}x)")
    print(f"  restart(i), one worker replaced: {restart_s:.2f} s;  close (workers, actors, Ray): {close_s:.2f} s")
    print(f"  memory (RSS): actor serving a worker {actor_mb:.0f} MB; plain worker {plain_mb:.0f} MB")
    ratios = {}
    for k, label in (("echo", "64 B echo"), ("call", "linear 256x256, batch 8")):
        ratios[k] = med["cluster"][k] / med["plain"][k]
        print(f"  per call, {label:24s}: cluster {med['cluster'][k]:8.1f} us | plain {med['plain'][k]:8.1f} us "
              f"| ratio {ratios[k]:.2f}x")
    missed = [f"{k} per-call ratio {r:.2f} > 1.25" for k, r in ratios.items() if r > 1.25]
    if warm_s > 2 * plain_s:
        missed.append(f"warm start {warm_s:.2f} s > 2x plain {plain_s:.2f} s")
    print("targets:", "met" if not missed else "MISSED: " + "; ".join(missed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(plain_start_s=plain_s, warm_start_s=warm_s, cold_start_s=cold_s, restart_s=restart_s,
                           close_s=close_s, actor_rss_mb=actor_mb, plain_rss_mb=plain_mb, per_call_us=med,
                           ratios=ratios, missed=missed), f, indent=2)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
