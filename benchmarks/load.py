"""Load: many client processes calling one worker on loopback with mixed graphs.

Starts a ``remotorch serve`` worker (or uses ``--url``), compiles three
models with remotorch once (an MLP, a small CNN, a transformer block), then
forks N client processes. Each client gives the models weights of its own
(so every client uploads different content), computes the expected outputs
of a fixed set of inputs locally, and, once every client is ready, makes
``--calls`` calls cycling through the models and inputs, checking every
output against the local one. A call is sent without waiting and its output
stands here as a placeholder until read, so each call's latency runs to its
output read (a failure on the worker is raised there too). Reported: calls,
errors, wrong results, throughput (calls per second over the loaded phase)
and latency percentiles.
A single client runs the same calls first, in the same run, as the baseline
for the ratios.

    python benchmarks/load.py                 # 16 clients x 500 calls
    python benchmarks/load.py --clients 4 --calls 100 --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import subprocess
import sys
import time

import torch

import remotorch
from remotorch import models
from remotorch.client.embedded import spawn_worker
from remotorch.client.remote import RemoteTensor
from remotorch.codec import messages as m

INPUTS_PER_MODEL = 8


# ---------------------------------------------------------------------- clients
class Models:
    """The three compiled models, made once in the parent (forked children inherit the compiled code)."""

    def __init__(self, url: str, token: str) -> None:
        torch.manual_seed(0)
        self.session = remotorch.Session(url, token=token, timeout=120)  # not connected: children connect
        self.nets = [(models.mlp().eval(), (8, 784)), (models.SmallCNN().eval(), (2, 3, 32, 32)),
                     (models.TransformerBlock().eval(), (2, 16, 64))]
        self.compiled = [remotorch.compile(net, session=self.session, fallback="raise") for net, _ in self.nets]
        with torch.no_grad():  # dynamo traces and captures here, once
            for (net, shape), compiled in zip(self.nets, self.compiled):
                compiled(torch.randn(*shape))
        conn = self.session.connection  # the parent's own session ends; children open theirs
        conn.transport.request(m.encode(m.Detach()))
        conn.drop()


def client(shared: Models, seed: int, calls: int, pipe) -> None:
    """One forked client: own weights, own connection, every output checked."""
    session = shared.session  # forked: give it an identity of its own on the worker
    conn = session.connection
    conn.link.session_id, conn.link.lease_s = secrets.token_urlsafe(24), None
    g = torch.Generator().manual_seed(seed)
    cases = []
    with torch.no_grad():
        for (net, shape), compiled in zip(shared.nets, shared.compiled):
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)  # this client's own weights
            for _ in range(INPUTS_PER_MODEL):
                x = torch.randn(*shape, generator=g)
                cases.append((compiled, x, net(x)))
            compiled(cases[-1][1])  # warm: uploaded and compiled before the clock starts
    pipe.send("ready")
    pipe.recv()  # the go signal: every client starts together
    lat, errors, wrong = [], [], 0
    with torch.no_grad():
        for i in range(calls):
            compiled, x, expected = cases[(i * 7 + seed) % len(cases)]
            start = time.perf_counter()
            try:
                out = compiled(x)
                if type(out) is RemoteTensor:
                    out.materialize_()  # the read: it waits for the reply, and raises the call's failure
            except remotorch.errors.RemoteError as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            lat.append((time.perf_counter() - start) * 1e3)
            if not torch.allclose(out, expected, rtol=1e-5, atol=1e-6):
                wrong += 1
    session.close()
    pipe.send({"lat_ms": lat, "errors": errors, "wrong": wrong})


# ---------------------------------------------------------------------- parent
def start_worker(token: str, threads: int):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTORCH_")}
    return spawn_worker(["--port", "0", "--token", token, "--name", "load", "--threads", str(threads)],
                        env=env, stderr=subprocess.DEVNULL)


def run_clients(shared: Models, n: int, calls: int) -> dict:
    """Fork n clients, wait until all are ready, release them together; the merged results."""
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for i in range(n):
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=client, args=(shared, 1000 + i, calls, child_end), daemon=True)
        proc.start()
        pipes.append(parent_end)
        procs.append(proc)
    for p in pipes:
        if not p.poll(300) or p.recv() != "ready":
            raise SystemExit("a client failed to start")
    start = time.perf_counter()
    for p in pipes:
        p.send("go")
    results = [p.recv() for p in pipes]
    elapsed = time.perf_counter() - start
    for proc in procs:
        proc.join(30)
    lat = sorted(x for r in results for x in r["lat_ms"])
    errors = [e for r in results for e in r["errors"]]
    return {"clients": n, "calls": n * calls, "ok": len(lat), "errors": len(errors), "error_samples": errors[:5],
            "wrong": sum(r["wrong"] for r in results), "seconds": elapsed,
            "throughput": len(lat) / elapsed if elapsed else 0.0,
            "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": lat[-1] if lat else 0.0}


def pct(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--calls", type=int, default=500, help="calls per client")
    ap.add_argument("--url", default=None, help="an existing worker (default: start one)")
    ap.add_argument("--token", default=None)
    ap.add_argument("--worker-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="kernel threads of the started worker (default: half the cores, as embedded)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the single-client run")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
    token = args.token or secrets.token_hex(16)
    worker = None
    url = args.url
    if url is None:
        worker = start_worker(token, args.worker_threads)
        url = worker.url
    torch.set_num_threads(1)  # before any kernel runs: forked children must not inherit a thread pool
    try:
        shared = Models(url, token)
        base = None if args.no_baseline else run_clients(shared, 1, args.calls)
        load = run_clients(shared, args.clients, args.calls)
    finally:
        if worker is not None:
            worker.stop()
    report = {"load": load, "baseline": base, "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if load["errors"] == 0 and load["wrong"] == 0 and load["ok"] == load["calls"] else 1


def print_report(report: dict) -> None:
    load, base = report["load"], report["baseline"]
    print(f"remotorch load: one worker on loopback, {report['cpus']} CPUs shared by worker and clients")
    print(f"{'run':>20} {'calls':>7} {'errors':>6} {'wrong':>5} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, r in (("1 client", base), (f"{load['clients']} clients", load)):
        if r is None:
            continue
        print(f"{name:>20} {r['calls']:>7} {r['errors']:>6} {r['wrong']:>5} {r['throughput']:>9.1f} "
              f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['max_ms']:>8.2f}")
    if base:
        print(f"throughput {load['clients']} clients / 1 client: {load['throughput'] / base['throughput']:.2f}x;"
              f" p99 {load['clients']} clients / p50 1 client: {load['p99_ms'] / base['p50_ms']:.1f}x")
    for e in load["error_samples"]:
        print("error:", e)


if __name__ == "__main__":
    sys.exit(main())
