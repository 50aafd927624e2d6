"""Where one warm call's time goes, phase by phase, on the client and on the worker.

The worker is a real ``remotorch serve`` process; both processes stamp the same
points of each call with ``time.perf_counter`` (the host's monotonic clock,
common to processes on one machine), by wrapping the functions at the phase
boundaries (the worker's wrappers are installed by the small program that
starts it, before it serves). The model is the peer benchmark's MLP
(784-256-10, batch 32, ``torch.no_grad``), one intra-op thread per process,
the output read after each call. After a warm-up, ``--calls`` calls are
stamped and each phase's median is printed, with the floor's total for
scale (a raw-socket server doing the same work, ``benchmarks/_peers``).

Phases, in order (client C, worker W):

- C dynamo in: from the call to remotorch's ``Connection.run`` (dynamo's
  guards, the frame, gathering the parameters);
- C build + encode: ``Connection.run`` to the first byte sent (the request,
  its arguments, the envelope, the MAC);
- C send: writing the request;
- wire + W receive: end of send to the worker holding the verified message
  (includes the worker waking, reading and checking the MAC);
- W prepare: to the graph's start (decode, argument values, checks);
- W graph: the engine's callable;
- W after graph + encode: to the reply queued (outputs disposed, encoded, MAC);
- W send: writing the reply;
- wire + C receive: the worker's end of send to the client holding the reply;
- C unpack + dynamo out: to the output in the caller's hands.

``--model gpt2`` (or ``block``) takes the peer benchmark's other models
instead (``benchmarks/_peers/models.py``).

    python benchmarks/warm_call.py [--calls 2000] [--transport tcp|unix] [--model mlp|block|gpt2]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import remotorch

# The worker's program: the stamps, then remotorch serve. Stamps are kept in memory and written
# to STAMPS_PATH when the worker is stopped (SIGTERM).
WORKER = r'''
import atexit, json, os, sys, time
from remotorch.transport import framing
from remotorch.worker import service, worker as worker_mod
stamps = []
def wrap(owner, name, key):
    inner = getattr(owner, name)
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        stamps.append((key, t0, time.perf_counter(), out is not None if key == "poll" else True))
        return out
    setattr(owner, name, wrapped)
init = framing.FramedChannel.__init__
def channel_init(self, *a, **k):  # per channel: the compiled framing's methods are the instance's own
    init(self, *a, **k)
    for name in ("poll", "queue", "flush"):
        wrap(self, name, name)
framing.FramedChannel.__init__ = channel_init
wrap(worker_mod.Worker, "_call", "graph")
wrap(service.Service, "handle", "handle")
def dump():
    with open(os.environ["STAMPS_PATH"], "w") as f:
        json.dump(stamps, f)
atexit.register(dump)
from remotorch.cli import main
sys.exit(main(sys.argv[1:]))
'''


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).eval()


def start_worker(transport: str, folder: str, token: str, stamps: str) -> tuple[subprocess.Popen, str]:
    listen = ["--unix", os.path.join(folder, "w.sock")] if transport == "unix" else ["--port", "0"]
    env = dict(os.environ, REMOTORCH_TOKEN=token, STAMPS_PATH=stamps)
    env.pop("REMOTORCH_CACHE_DIR", None)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, "serve", *listen, "--threads", "1", "--no-cache"],
                            env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if "serving on" not in line:
        proc.kill()
        raise RuntimeError(f"the worker did not start: {line!r}")
    return proc, line.split("serving on", 1)[1].strip()


def client_stamps(conn) -> list:
    """Wrap the client's phase boundaries on this connection; returns the list they append to."""
    stamps: list = []
    run = conn.run

    def timed_run(*a, **k):
        t0 = time.perf_counter()
        out = run(*a, **k)
        stamps.append(("run", t0, time.perf_counter()))
        return out
    conn.run = timed_run
    transport = conn.link._transport
    from remotorch.transport import framing
    channel = transport._channel
    send, recv = channel.send, channel.recv

    def timed_send(*a, **k):
        t0 = time.perf_counter()
        out = send(*a, **k)
        stamps.append(("send", t0, time.perf_counter()))
        return out

    def timed_recv(*a, **k):
        t0 = time.perf_counter()
        out = recv(*a, **k)
        stamps.append(("recv", t0, time.perf_counter()))
        return out
    poll = channel.poll

    def timed_poll(*a, **k):  # the client polls for its reply while it spins (compiled framing)
        t0 = time.perf_counter()
        out = poll(*a, **k)
        if out is not None:
            stamps.append(("recv", t0, time.perf_counter()))
        return out
    assert isinstance(channel, framing.FramedChannel)
    channel.send, channel.recv, channel.poll = timed_send, timed_recv, timed_poll
    return stamps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--transport", choices=("tcp", "unix"), default="tcp")
    ap.add_argument("--model", choices=("mlp", "block", "gpt2"), default="mlp")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    token = secrets.token_hex(16)
    folder = tempfile.mkdtemp(prefix="remotorch-warm-call-")
    stamps_path = os.path.join(folder, "stamps.json")
    proc, url = start_worker(args.transport, folder, token, stamps_path)
    if args.model == "mlp":
        model, x = mlp(), torch.randn(32, 784, generator=torch.Generator().manual_seed(1))
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _peers.models import build_module, example_input
        model, x = build_module(args.model), example_input(args.model)
    with torch.no_grad():
        want = model(x)
    calls = []
    try:
        with remotorch.Session(url, token=token) as s, torch.no_grad():
            f = remotorch.compile(model, session=s, fallback="raise")
            for _ in range(300 if args.model == "mlp" else 20):
                f(x).sum()
            conn = s.connection
            mine = client_stamps(conn)
            warm_at = time.perf_counter()
            for _ in range(args.calls):
                t0 = time.perf_counter()
                y = f(x)
                y.sum()  # read: the output is in this process
                calls.append((t0, time.perf_counter()))
            if not torch.allclose(y, want, atol=1e-5):
                print("WRONG RESULT")
                return 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    with open(stamps_path) as fh:
        theirs = [tuple(s) for s in json.load(fh) if s[1] >= warm_at]
    by_key: dict[str, list] = {}
    for key, *rest in theirs:
        by_key.setdefault(key, []).append(rest)
    for key, *rest in mine:
        by_key.setdefault("c_" + key, []).append(rest)
    polls = [p for p in by_key["poll"] if p[2]]  # the polls that returned a message
    phases: dict[str, list] = {k: [] for k in (
        "C dynamo in", "C build + encode", "C send", "wire + W receive", "W prepare", "W graph",
        "W after graph + encode", "W send", "wire + C receive", "C unpack + dynamo out", "total")}

    def first_after(items, t, index=0):
        for it in items:
            if it[index] >= t:
                return it
        return None
    for (t0, t1), run, send, recv in zip(calls, by_key["c_run"], by_key["c_send"], by_key["c_recv"]):
        poll = first_after(polls, send[1], 1)
        graph = first_after(by_key["graph"], send[1])
        queue = first_after(by_key["queue"], send[1])
        flush = first_after(by_key["flush"], queue[1] if queue else send[1])
        if not (poll and graph and queue and flush) or flush[1] > recv[1] + 1e-3:
            continue
        phases["C dynamo in"].append(run[0] - t0)
        phases["C build + encode"].append(send[0] - run[0])
        phases["C send"].append(send[1] - send[0])
        phases["wire + W receive"].append(poll[1] - send[1])
        phases["W prepare"].append(graph[0] - poll[1])
        phases["W graph"].append(graph[1] - graph[0])
        phases["W after graph + encode"].append(queue[1] - graph[1])
        phases["W send"].append(flush[1] - queue[1])
        phases["wire + C receive"].append(recv[1] - flush[1])
        phases["C unpack + dynamo out"].append(t1 - recv[1])
        phases["total"].append(t1 - t0)
    matched = len(phases["total"])
    what = "MLP 784-256-10, batch 32" if args.model == "mlp" else args.model
    print(f"warm call phases: {what}, {args.transport}, one thread per process, "
          f"{matched} of {len(calls)} calls matched")
    total = statistics.median(phases["total"])
    for name, values in phases.items():
        med = statistics.median(values)
        share = "" if name == "total" else f"{med / total:6.1%}"
        print(f"  {name:24s} {med * 1e6:8.1f} µs {share}")
    print("  (medians of each phase; they need not add up to the median total)")
    every = sorted(t1 - t0 for t0, t1 in calls)
    p50, p99 = every[len(every) // 2], every[int(len(every) * 0.99)]
    print(f"  all {len(every)} warm calls: median {p50 * 1e6:.1f} µs, p99 {p99 * 1e6:.1f} µs, "
          f"p99 / median {p99 / p50:.2f} (nothing else measured meanwhile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
