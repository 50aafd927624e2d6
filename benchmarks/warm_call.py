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
- C after the reply: unpack, and the rest of the call to the output read in
  the caller's hands.

A call is sent without waiting: it returns a placeholder for its output at
once, and the read (``y.sum()``) waits for the reply. So the client's way
out of the call (placeholders, dynamo out) runs while the worker works, and
is printed apart ("C out of the call, before the reply"), not in the
total's path; where a call waited for its reply (remotorch before only a
read waited), that row is 0 and its work is in "C after the reply".

``--model gpt2`` (or ``block``) takes the peer benchmark's other models
instead (``benchmarks/_peers/models.py``).

``--floor`` stamps the "floor compiled" of ``benchmarks/peers.py`` the same
way instead, for the same model: ``torch.compile`` with a backend that sends
the input's raw bytes over TCP to a server running the module and returns
its raw reply (no framing, no MAC, one reused output buffer), each call's
output read. Phases: dynamo in (to the backend's function), send, wire +
server receive, server compute, server send, client receive (the rest after
the server's send), dynamo out + read.

    python benchmarks/warm_call.py [--calls 2000] [--transport tcp|unix] [--model mlp|block|gpt2] [--floor]
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
if hasattr(worker_mod.Worker, "_call"):  # remotorch before the run path moved to worker/guard.py
    wrap(worker_mod.Worker, "_call", "graph")
else:
    wrap(worker_mod, "timed_call", "graph")
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


# The floor's server for --floor: the module, raw bytes in and out, each call's compute and send stamped.
FLOOR = r'''
import json, socket, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[3])
import warm_call
model, ex = warm_call.model_and_input(sys.argv[1])
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(ex.numel() * ex.element_size())
view = memoryview(buf)
x = torch.frombuffer(buf, dtype=ex.dtype).view(ex.shape)
stamps = []
with torch.no_grad():
    while True:
        got = 0
        while got < len(view):
            k = conn.recv_into(view[got:], len(view) - got)
            if not k:
                with open(sys.argv[2], "w") as f:
                    json.dump(stamps, f)
                sys.exit(0)
            got += k
        t0 = time.perf_counter()
        y = model(x).contiguous()
        t1 = time.perf_counter()
        conn.sendall(memoryview(y.numpy()).cast("B"))
        stamps.append((t0, t1, time.perf_counter()))
'''


def model_and_input(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    if name == "mlp":
        return mlp(), torch.randn(32, 784, generator=torch.Generator().manual_seed(1))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _peers.models import build_module, example_input
    return build_module(name), example_input(name)


def floor_phases(name: str, calls: int) -> int:
    """``--floor``: the floor compiled's phases for the same model (see the module's docstring)."""
    import socket

    folder = tempfile.mkdtemp(prefix="remotorch-warm-call-")
    stamps_path = os.path.join(folder, "floor.json")
    proc = subprocess.Popen([sys.executable, "-c", FLOOR, name, stamps_path, os.path.dirname(os.path.abspath(__file__))],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    model, x = model_and_input(name)
    sock = socket.create_connection(("127.0.0.1", int(proc.stdout.readline())))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with torch.no_grad():
        want = model(x)
    out = torch.empty_like(want)
    view = memoryview(out.numpy()).cast("B")
    mine: list = []

    def call(arg: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        sock.sendall(memoryview(arg.numpy()).cast("B"))
        t1 = time.perf_counter()
        got = 0
        while got < len(view):
            k = sock.recv_into(view[got:], len(view) - got)
            if not k:
                raise ConnectionError("the floor server closed the connection")
            got += k
        mine.append((t0, t1, time.perf_counter()))
        return out

    def backend(gm, example_inputs):
        i = next(j for j, t in enumerate(example_inputs) if type(t) is torch.Tensor)
        return lambda *a: (call(a[i]),)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    timed = []
    try:
        with torch.no_grad():
            for _ in range(300 if name == "mlp" else 20):
                compiled(x).sum()
            warm = len(mine)
            for _ in range(calls):
                t0 = time.perf_counter()
                y = compiled(x)
                y.sum()
                timed.append((t0, time.perf_counter()))
            if not torch.allclose(y, want, atol=1e-5):
                print("WRONG RESULT")
                return 1
    finally:
        sock.close()
        proc.wait(timeout=60)
    with open(stamps_path) as fh:
        theirs = json.load(fh)[warm:]
    phases: dict[str, list] = {k: [] for k in ("dynamo in", "send", "wire + server receive", "server compute",
                                               "server send", "client receive", "dynamo out + read", "total")}
    for (t0, t9), (a, b, done), (s0, s1, s2) in zip(timed, mine[warm:], theirs):
        for key, value in zip(phases, (a - t0, b - a, s0 - b, s1 - s0, s2 - s1, done - s2, t9 - done, t9 - t0)):
            phases[key].append(value)
    print(f"floor compiled phases: {name}, tcp, one thread per process, {len(timed)} calls")
    total = statistics.median(phases["total"])
    for key, values in phases.items():
        med = statistics.median(values)
        print(f"  {key:24s} {med * 1e6:8.1f} µs {'' if key == 'total' else f'{med / total:6.1%}'}")
    print("  (medians of each phase; they need not add up to the median total)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--transport", choices=("tcp", "unix"), default="tcp")
    ap.add_argument("--model", choices=("mlp", "block", "gpt2"), default="mlp")
    ap.add_argument("--floor", action="store_true", help="stamp the floor compiled instead of remotorch")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.floor:
        return floor_phases(args.model, args.calls)
    token = secrets.token_hex(16)
    folder = tempfile.mkdtemp(prefix="remotorch-warm-call-")
    stamps_path = os.path.join(folder, "stamps.json")
    proc, url = start_worker(args.transport, folder, token, stamps_path)
    model, x = model_and_input(args.model)
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
                returned = time.perf_counter()
                y.sum()  # read: the output is in this process
                calls.append((t0, time.perf_counter(), returned))
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
        "W after graph + encode", "W send", "wire + C receive", "C after the reply", "total",
        "C out of the call, before the reply")}

    def first_after(items, t, index=0):
        for it in items:
            if it[index] >= t:
                return it
        return None
    for (t0, t1, returned), run, send, recv in zip(calls, by_key["c_run"], by_key["c_send"], by_key["c_recv"]):
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
        phases["C after the reply"].append(t1 - recv[1])
        phases["total"].append(t1 - t0)
        phases["C out of the call, before the reply"].append(returned - run[1] if returned <= recv[0] else 0.0)
    matched = len(phases["total"])
    what = "MLP 784-256-10, batch 32" if args.model == "mlp" else args.model
    print(f"warm call phases: {what}, {args.transport}, one thread per process, "
          f"{matched} of {len(calls)} calls matched")
    total = statistics.median(phases["total"])
    for name, values in phases.items():
        med = statistics.median(values)
        share = "" if name == "total" else f"{med / total:6.1%}"
        if name == "C out of the call, before the reply":
            share = " (while the worker works: not in the total's path)"
        print(f"  {name:36s} {med * 1e6:8.1f} µs {share}")
    print("  (medians of each phase; they need not add up to the median total)")
    every = sorted(t1 - t0 for t0, t1, _ in calls)
    p50, p99 = every[len(every) // 2], every[int(len(every) * 0.99)]
    print(f"  all {len(every)} warm calls: median {p50 * 1e6:.1f} µs, p99 {p99 * 1e6:.1f} µs, "
          f"p99 / median {p99 / p50:.2f} (nothing else measured meanwhile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
