"""How much does running a graph on a remotorch worker cost over the wire itself?

Everything below is measured in one run on this machine, and every ratio is
computed from figures of that same run:

1. Raw TCP: a 64-byte round trip between two processes over plain sockets
   (TCP_NODELAY, ``sendall`` + ``recv_into`` a reused buffer). This is the
   floor any transport on this machine pays.
2. pyzmq REQ/REP: the same 64-byte round trip. The design named ZeroMQ as the
   first choice; this figure shows what it would have cost per call compared
   with the plain-socket transport remotorch uses.
3. The tiny MLP (``remotorch.models.mlp()``, batch 32×784, no grad): local
   eager vs ``remotorch.compile(..., fallback="raise")`` on a real
   ``remotorch serve`` worker subprocess. Local and remote calls are timed one
   by one in interleaved rounds, so machine noise hits both alike. A remote
   call is sent without waiting and its output stands here as a placeholder
   until read, so each timed remote call (and each ``run_graph``) reads its
   output before the clock stops: the time until the value is in hand. Two
   intermediate rows split the remote call: ``session.echo`` of 64 bytes (the
   remotorch framing, HMAC, msgpack and the worker's serving loop) and
   ``session.run_graph`` called directly (everything except dynamo's guards
   and the aot_autograd wrapper). The worker's own graph time comes from
   ``session.stats()["remote_ms"]``. A raw TCP echo of the MLP input's size
   shows what moving those bytes costs by itself.

   When the worker is spawned here, this process and the worker each get half
   the CPUs' intra-op threads (``--threads``): two processes that each start
   a full OpenMP team on the same cores oversubscribe them, and the small
   MLP then takes tens of milliseconds instead of about a hundred microseconds.
   The same rounds also time a second spawned worker on a Unix socket
   (``serve --unix``, what the embedded worker uses), against a raw Unix
   socket round trip; that section is for information. So do a third worker
   and a session that busy-poll (``serve --spin-us``, ``Session(spin_us=)``)
   instead of sleeping between messages: on a VM, waking a halted vCPU is
   a large part of each round trip.
4. Overhead ratio = (remote median - local median) / raw TCP median; target <= 1.5.
   For scale, a raw TCP round trip carrying the call's own tensor bytes (the
   98 KiB input there, the 1.25 KiB output back) is printed too: that much of
   the overhead is moving the bytes at all, whatever the transport.
5. Bytes on the wire per warm MLP call vs the input + output tensor bytes;
   target <= inputs + outputs + 1 KiB.
6. Bulk: a 256 MB float32 tensor sent to the worker and back with
   ``session.echo`` vs the same over raw TCP into a reused buffer;
   GB/s = 2 x size / time, best and median of 5 interleaved runs (3 with
   ``--quick``); target remotorch/raw >= 0.8 (judged on the best run, the
   least disturbed by other load: on a shared host one 256 MB round trip
   of the same code varies 2-4x from run to run, raw TCP's too). For
   information, the same through pyzmq REQ/REP with ``copy=False`` (the
   figure behind docs/protocol.md section 16), a 256 MB ``x + 1`` graph
   run remotely vs locally, and the time of the four GMAC passes that
   authenticating a bulk round trip costs (docs/protocol.md section 4).

The script exits 1 when it misses a target (the overhead ratio, plain and
spinning, the wire bytes, the bulk ratio); a wrong result on any path stops
it with an error before anything is timed.

Usage::

    python benchmarks/overhead.py [--device cpu|cuda] [--url tcp://h:p --token T]
                                  [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import zmq

import remotorch
from remotorch.client.embedded import spawn_worker
from remotorch.client.remote import fetch_all
from remotorch import models
from remotorch.transport import framing

OVERHEAD_TARGET = 1.5
WIRE_SLACK_BYTES = 1024
BULK_TARGET = 0.8
SPIN_US = 2000  # the busy-polling window of the spinning worker and session
MSG = b"x" * 64

# A raw-socket echo server: each connection first says its message size and its
# reply size (u64 each), then every message is received into one reused buffer
# and answered with that many bytes of it.
RAW_ECHO_SERVER = r"""
import os, socket, struct, sys, threading
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()

def fill(conn, view, n):
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            return False
        got += k
    return True

def serve(conn):
    if conn.family == socket.AF_INET:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(16)
    if not fill(conn, memoryview(head), 16):
        return
    n, r = struct.unpack("<QQ", head)
    view = memoryview(bytearray(max(n, r)))
    while fill(conn, view, n):
        conn.sendall(view[:r])

def accept_all(srv):
    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()

srv = socket.create_server(("127.0.0.1", 0))
unix_path = sys.argv[1] if len(sys.argv) > 1 else ""
if unix_path:
    usrv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    usrv.bind(unix_path)
    usrv.listen()
    threading.Thread(target=accept_all, args=(usrv,), daemon=True).start()
print(srv.getsockname()[1], flush=True)
accept_all(srv)
"""

ZMQ_ECHO_SERVER = r"""
import os, sys, threading, zmq
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
sock = zmq.Context().socket(zmq.REP)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    sock.send(sock.recv(copy=False), copy=False)
"""


# ---------------------------------------------------------------------------- processes
class Child:
    """A helper subprocess that prints one ready line; it exits when we close its stdin."""

    def __init__(self, cmd: list[str], ready: Callable[[str], str | None], timeout: float = 120.0,
                 env: dict | None = None):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        found: list[str] = []

        def read() -> None:
            for line in self.proc.stdout:
                value = ready(line)
                if value is not None:
                    found.append(value)
                    break
            for _ in self.proc.stdout:  # keep draining so the child never blocks
                pass
        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.01)
        if not found:
            self.stop()
            raise RuntimeError(f"{cmd[:4]} did not start:\n{''.join(self.stderr)}")
        self.value = found[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def python_child(source: str, *args: str) -> Child:
    return Child([sys.executable, "-c", source, *args], ready=lambda line: line.strip() or None)


class WorkerChild:
    """A real ``remotorch serve`` (started by the library's ``spawn_worker``), as a :class:`Child`."""

    def __init__(self, args: list[str], env: dict) -> None:
        self._worker = spawn_worker(args, env=env, stdin=subprocess.PIPE)
        self.value = self._worker.url

    def stop(self) -> None:
        self._worker.stop()


def worker_child(device: str, token: str, threads: int, unix_path: str | None = None,
                 spin_us: float = 0) -> WorkerChild:
    """A real ``remotorch serve`` on a free loopback port (or a Unix socket), ``threads`` intra-op threads."""
    listen = ["--unix", unix_path] if unix_path else ["--host", "127.0.0.1", "--port", "0"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return WorkerChild([*listen, "--spin-us", str(spin_us), "--token", token, "--device", device,
                        "--name", "bench", "--exit-on-stdin-close"], env)


# ------------------------------------------------------------------------------ clients
class RawClient:
    """One connection to the raw echo server (TCP, or a Unix socket path): ``size`` bytes there, ``reply`` back."""

    def __init__(self, port: int | str, size: int, reply: int | None = None) -> None:
        reply = size if reply is None else reply
        if isinstance(port, str):  # a Unix socket path
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(port)
        else:
            self.sock = socket.create_connection(("127.0.0.1", port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(size.to_bytes(8, "little") + reply.to_bytes(8, "little"))
        self.buf = np.ones(reply, dtype=np.uint8)  # touched now: no page faults while timing
        self.view = memoryview(self.buf)
        self.size = reply

    def roundtrip(self, payload) -> None:
        self.sock.sendall(payload)
        got, n, view = 0, self.size, self.view
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if not k:
                raise ConnectionError("echo server closed the connection")
            got += k

    def close(self) -> None:
        self.sock.close()


class ZmqClient:
    """A REQ socket to the pyzmq echo server."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def roundtrip(self, payload: bytes) -> None:
        self.sock.send(payload)
        self.sock.recv()

    def roundtrip_bulk(self, payload) -> int:
        """Zero-copy send and receive (``copy=False``), as the design doc measured it."""
        self.sock.send(payload, copy=False)
        return len(self.sock.recv(copy=False).buffer)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


# ---------------------------------------------------------------------------- timing
def read(out):
    """``out`` (a tensor, or a list of them) with its data in this process: a remote call returns
    placeholders at once (it is sent without waiting), and only a read waits for the worker."""
    fetch_all(out if isinstance(out, (list, tuple)) else (out,))
    return out


def summary(samples_ns: list[int]) -> dict:
    """Median and p99 of per-call samples, in microseconds."""
    s = sorted(samples_ns)
    p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
    return {"median_us": statistics.median(s) / 1e3, "p99_us": p99 / 1e3, "n": len(s)}


def interleaved(probes: dict[str, Callable[[], object]], rounds: int, per_round: int,
                warmup: int) -> dict[str, dict]:
    """Time each probe call by call, in rounds that rotate the probe order."""
    for fn in probes.values():
        for _ in range(warmup):
            fn()
    names = list(probes)
    samples: dict[str, list[int]] = {n: [] for n in names}
    clock = time.perf_counter_ns
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn, out = probes[name], samples[name]
            for _ in range(per_round):
                t0 = clock()
                fn()
                out.append(clock() - t0)
    return {n: summary(samples[n]) for n in names}


def capture_run_graph_call(session: remotorch.Session, compiled, x) -> tuple:
    """(graph, flat args) of one compiled call, seen by shadowing run_graph on this instance."""
    seen = []
    original = session.run_graph

    def spy(graph, args):
        seen.append((graph, list(args)))
        return original(graph, args)
    session.run_graph = spy
    try:
        compiled(x)
    finally:
        del session.run_graph
    if len(seen) != 1:
        raise RuntimeError(f"expected one graph per MLP call, saw {len(seen)}")
    return seen[0]


# ------------------------------------------------------------------------ measurements
def measure_latency(session, raw_port: int, zmq_port: int, quick: bool,
                    unix_session=None, raw_unix: str | None = None, spin_session=None) -> dict:
    """Rows 1-3: raw TCP, pyzmq, remotorch echo, run_graph, MLP local vs remote (and over a Unix socket)."""
    torch.manual_seed(0)
    model = models.mlp().eval()
    x = torch.randn(32, 784)
    compiled = remotorch.compile(model, session=session, fallback="raise")
    x_bytes = x.numpy().tobytes()
    out_bytes = model(x).numel() * 4
    raw, raw_x, zq = RawClient(raw_port, len(MSG)), RawClient(raw_port, len(x_bytes)), ZmqClient(zmq_port)
    raw_call = RawClient(raw_port, len(x_bytes), out_bytes)
    clients = [raw, raw_x, raw_call, zq]
    try:
        with torch.no_grad():
            expected = model(x)
            torch.testing.assert_close(compiled(x), expected)
            graph, args = capture_run_graph_call(session, compiled, x)
            probes = {
                "raw_tcp_64B": lambda: raw.roundtrip(MSG),
                "raw_tcp_input_size": lambda: raw_x.roundtrip(x_bytes),
                "raw_tcp_call_bytes": lambda: raw_call.roundtrip(x_bytes),
                "zmq_reqrep_64B": lambda: zq.roundtrip(MSG),
                "remotorch_echo_64B": lambda: session.echo([MSG]),
                "session_run_graph": lambda: read(session.run_graph(graph, args)),
                "mlp_local": lambda: model(x),
                "mlp_remote": lambda: read(compiled(x)),
            }
            if unix_session is not None:
                on_unix = remotorch.compile(model, session=unix_session, fallback="raise")
                torch.testing.assert_close(on_unix(x), expected)
                raw_u, raw_u_call = RawClient(raw_unix, len(MSG)), RawClient(raw_unix, len(x_bytes), out_bytes)
                clients += [raw_u, raw_u_call]
                probes |= {"raw_unix_64B": lambda: raw_u.roundtrip(MSG),
                           "raw_unix_call_bytes": lambda: raw_u_call.roundtrip(x_bytes),
                           "unix_echo_64B": lambda: unix_session.echo([MSG]),
                           "mlp_remote_unix": lambda: read(on_unix(x))}
            if spin_session is not None:
                spinning = remotorch.compile(model, session=spin_session, fallback="raise")
                torch.testing.assert_close(spinning(x), expected)
                probes |= {"spin_echo_64B": lambda: spin_session.echo([MSG]),
                           "mlp_remote_spin": lambda: read(spinning(x))}
            before = session.stats()
            rows = interleaved(probes, rounds=10 if quick else 40, per_round=50, warmup=50 if quick else 200)
            after = session.stats()
            calls = after["remote_calls"] - before["remote_calls"]
            rows["worker_graph_mean_us"] = (after["remote_ms"] - before["remote_ms"]) / calls * 1e3
            rows["wire"] = wire_bytes(session, compiled, x, expected, n=200)
    finally:
        for client in clients:
            client.close()
    return rows


def wire_bytes(session, compiled, x, expected, n: int) -> dict:
    """Bytes sent + received per warm compiled call (its output read), against the tensors' own bytes."""
    out_bytes = expected.numel() * expected.element_size()
    in_bytes = x.numel() * x.element_size()
    session.synchronize()
    before = session.stats()
    for _ in range(n):
        read(compiled(x))
    session.synchronize()
    after = session.stats()
    sent = (after["bytes_sent"] - before["bytes_sent"]) / n
    received = (after["bytes_received"] - before["bytes_received"]) / n
    return {"sent_per_call": sent, "received_per_call": received, "input_bytes": in_bytes,
            "output_bytes": out_bytes, "overhead_bytes": sent + received - in_bytes - out_bytes}


def time_once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e9


def measure_bulk(session, raw_port: int, zmq_port: int, size_mb: int, repeats: int) -> dict:
    """Row 6: a large tensor through session.echo, raw TCP and pyzmq (and a remote x + 1)."""
    t = torch.rand(size_mb * (1 << 20) // 4)
    view = memoryview(t.numpy()).cast("B")
    raw, zq = RawClient(raw_port, view.nbytes), ZmqClient(zmq_port)
    add_one = remotorch.compile(lambda v: v + 1, session=session, fallback="raise")
    try:
        with torch.no_grad():
            check_bulk_paths(session, raw, zq, add_one, t, view)
            probes = {"raw_tcp": lambda: raw.roundtrip(view),
                      "remotorch_echo": lambda: session.echo([view]),
                      "zmq_reqrep": lambda: zq.roundtrip_bulk(view),
                      "graph_remote": lambda: read(add_one(t)),
                      "graph_local": lambda: t + 1}
            gmac = framing.frames_key(b"k" * 32)
            chunks = [view[at:at + framing._CHUNK] for at in range(0, view.nbytes, framing._CHUNK)]
            tag = lambda: [gmac.encrypt(framing._NONCE.pack(0, c), b"", piece) for c, piece in enumerate(chunks)]
            probes["gmac_x4"] = lambda: [tag() for _ in range(4)]
            times: dict[str, list[float]] = {name: [] for name in probes}
            for r in range(repeats):
                for name in list(probes)[r % len(probes):] + list(probes)[:r % len(probes)]:
                    times[name].append(time_once(probes[name]))
    finally:
        raw.close()
        zq.close()
    moved = 2 * view.nbytes
    return {name: {"best_s": min(ts), "median_s": statistics.median(ts),
                   "best_gbps": moved / min(ts) / 1e9, "median_gbps": moved / statistics.median(ts) / 1e9}
            for name, ts in times.items()} | {"bytes": view.nbytes, "repeats": repeats}


def check_bulk_paths(session, raw: RawClient, zq: ZmqClient, add_one, t, view) -> None:
    """One untimed round trip on every path (warm-up), checking what comes back."""
    raw.roundtrip(view)
    assert np.array_equal(raw.buf, np.asarray(view))
    echoed = session.echo([view])[0]
    assert echoed.nbytes == view.nbytes and np.array_equal(echoed, np.asarray(view))
    del echoed
    assert zq.roundtrip_bulk(view) == view.nbytes
    torch.testing.assert_close(add_one(t), t + 1)


# ------------------------------------------------------------------------------ report
def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def print_latency(lat: dict) -> dict:
    labels = {
        "raw_tcp_64B": "raw TCP 64 B round trip (2 processes)",
        "raw_tcp_input_size": "raw TCP 98 KiB echo (MLP input, both ways)",
        "raw_tcp_call_bytes": "raw TCP 98 KiB there, 1.25 KiB back (a call)",
        "zmq_reqrep_64B": "pyzmq REQ/REP 64 B round trip",
        "remotorch_echo_64B": "remotorch session.echo 64 B",
        "session_run_graph": "remotorch session.run_graph (MLP, no dynamo)",
        "mlp_local": "MLP local eager",
        "mlp_remote": "MLP remote (remotorch.compile)",
    }
    n = lat["mlp_remote"]["n"]
    print(f"\nLatency: calls timed one by one in interleaved rounds, {n} samples each")
    print(f"  {'':46s} {'median µs':>10s} {'p99 µs':>10s}")
    for key, label in labels.items():
        print(f"  {label:46s} {lat[key]['median_us']:10.1f} {lat[key]['p99_us']:10.1f}")
    print(f"  {'worker-side graph run (mean, from stats)':46s} {lat['worker_graph_mean_us']:10.1f}")
    raw = lat["raw_tcp_64B"]["median_us"]
    ratio = (lat["mlp_remote"]["median_us"] - lat["mlp_local"]["median_us"]) / raw
    print(f"\n  median vs raw TCP 64 B: pyzmq {lat['zmq_reqrep_64B']['median_us'] / raw:.2f}x, "
          f"remotorch echo {lat['remotorch_echo_64B']['median_us'] / raw:.2f}x")
    print("  split of the remote MLP call's median (differences of medians):")
    steps = [("raw TCP 64 B round trip", raw),
             ("+ framing, msgpack, worker threads (echo - raw)", lat["remotorch_echo_64B"]["median_us"] - raw),
             ("+ tensors in/out, worker run (run_graph - echo)", lat["session_run_graph"]["median_us"]
              - lat["remotorch_echo_64B"]["median_us"]),
             ("+ dynamo guards, aot wrapper (remote - run_graph)", lat["mlp_remote"]["median_us"]
              - lat["session_run_graph"]["median_us"])]
    for label, us in steps:
        print(f"    {label:50s} {us:8.1f} µs")
    extra = lat["mlp_remote"]["median_us"] - lat["mlp_local"]["median_us"]
    print(f"\n  overhead ratio (remote - local) / raw TCP = {extra:.1f} / {raw:.1f} = {ratio:.2f}  "
          f"(target <= {OVERHEAD_TARGET})  {verdict(ratio <= OVERHEAD_TARGET)}")
    floor = lat["raw_tcp_call_bytes"]["median_us"]
    print(f"  for scale: moving the call's own tensor bytes over raw TCP takes {floor:.1f} µs "
          f"= {floor / raw:.2f}x the 64 B round trip;\n  remotorch's overhead beyond that floor is "
          f"{extra - floor:.1f} µs = {(extra - floor) / raw:.2f}x")
    out = {"overhead_ratio": ratio, "overhead_pass": ratio <= OVERHEAD_TARGET,
           "call_bytes_floor_us": floor, "overhead_beyond_floor_ratio": (extra - floor) / raw}
    if "mlp_remote_unix" in lat:
        print("\n  Same host over a Unix socket (serve --unix; what the embedded worker uses), same rounds:")
        for key, label in (("raw_unix_64B", "raw Unix socket 64 B round trip"),
                           ("raw_unix_call_bytes", "raw Unix socket, the call's bytes"),
                           ("unix_echo_64B", "remotorch session.echo 64 B, unix://"),
                           ("mlp_remote_unix", "MLP remote, unix://")):
            print(f"    {label:44s} {lat[key]['median_us']:10.1f} {lat[key]['p99_us']:10.1f}")
        extra_u = lat["mlp_remote_unix"]["median_us"] - lat["mlp_local"]["median_us"]
        raw_u = lat["raw_unix_64B"]["median_us"]
        out |= {"unix_overhead_us": extra_u, "unix_overhead_vs_raw_tcp": extra_u / raw,
                "unix_overhead_vs_raw_unix": extra_u / raw_u}
        print(f"    (remote - local) over unix:// = {extra_u:.1f} µs = {extra_u / raw:.2f}x the raw TCP "
              f"64 B round trip, {extra_u / raw_u:.2f}x the raw Unix socket one (for information; "
              f"the target is defined on TCP)")
    if "mlp_remote_spin" in lat:
        print(f"\n  Busy-polling both ends (serve --spin-us {SPIN_US:g}, Session(spin_us={SPIN_US:g})), "
              f"TCP, same rounds:")
        for key, label in (("spin_echo_64B", "remotorch session.echo 64 B, spinning"),
                           ("mlp_remote_spin", "MLP remote, spinning")):
            print(f"    {label:44s} {lat[key]['median_us']:10.1f} {lat[key]['p99_us']:10.1f}")
        extra_s = lat["mlp_remote_spin"]["median_us"] - lat["mlp_local"]["median_us"]
        out |= {"spin_overhead_us": extra_s, "spin_overhead_ratio": extra_s / raw}
        print(f"    overhead ratio spinning (remote - local) / raw TCP = {extra_s:.1f} / {raw:.1f} = "
              f"{extra_s / raw:.2f}  (target <= {OVERHEAD_TARGET})  {verdict(extra_s / raw <= OVERHEAD_TARGET)}")
    return out


def print_wire(wire: dict) -> dict:
    tensors = wire["input_bytes"] + wire["output_bytes"]
    total = wire["sent_per_call"] + wire["received_per_call"]
    ok = total <= tensors + WIRE_SLACK_BYTES
    print(f"\nWire bytes per warm MLP call: sent {wire['sent_per_call']:.0f} + received "
          f"{wire['received_per_call']:.0f} = {total:.0f} B; tensors {tensors} B "
          f"(in {wire['input_bytes']} + out {wire['output_bytes']}); overhead {total - tensors:.0f} B "
          f"(target <= {WIRE_SLACK_BYTES})  {verdict(ok)}")
    return {"wire_pass": ok}


def print_bulk(bulk: dict) -> dict:
    mb = bulk["bytes"] >> 20
    print(f"\nBulk: {mb} MB float32 tensor to the worker and back, {bulk['repeats']} timed runs each")
    print(f"  {'':42s} {'best GB/s':>10s} {'median GB/s':>12s} {'best ms':>9s} {'median ms':>10s}")
    labels = {"raw_tcp": "raw TCP (recv_into a reused buffer)",
              "remotorch_echo": "remotorch session.echo",
              "zmq_reqrep": "pyzmq REQ/REP, copy=False",
              "graph_remote": "x + 1 remote (incl. compute)",
              "graph_local": "x + 1 local (compute only)",
              "gmac_x4": "4 GMAC passes, per 256 KiB chunk (auth share)"}
    for key, label in labels.items():
        r = bulk[key]
        gbps = (f"{r['best_gbps']:10.2f} {r['median_gbps']:12.2f}" if key not in ("graph_local", "gmac_x4")
                else f"{'':10s} {'':12s}")
        print(f"  {label:42s} {gbps} {r['best_s'] * 1e3:9.1f} {r['median_s'] * 1e3:10.1f}")
    best = bulk["remotorch_echo"]["best_gbps"] / bulk["raw_tcp"]["best_gbps"]
    med = bulk["remotorch_echo"]["median_gbps"] / bulk["raw_tcp"]["median_gbps"]
    ok = best >= BULK_TARGET
    print(f"\n  bulk ratio remotorch / raw: best {best:.2f}, median {med:.2f}  "
          f"(target >= {BULK_TARGET} on best)  {verdict(ok)}")
    return {"bulk_ratio_best": best, "bulk_ratio_median": med, "bulk_pass": ok}


# -------------------------------------------------------------------------------- main
def source_version() -> str:
    """remotorch's version, and the git commit of its checkout when there is one."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(remotorch.__file__), timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"remotorch {remotorch.__version__}" + (f" at {commit}" if commit else "")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="device of the spawned worker (cpu or cuda)")
    p.add_argument("--url", help="use this running worker (tcp://host:port) instead of spawning one; "
                                 "the raw TCP and pyzmq baselines still run on this machine's loopback")
    p.add_argument("--token", help="the worker's token (with --url; default $REMOTORCH_TOKEN)")
    p.add_argument("--threads", type=int,
                   help="intra-op threads for this process and a spawned worker (default: half the "
                        "CPUs each when the worker is spawned here, so the two do not oversubscribe)")
    p.add_argument("--quick", action="store_true", help="fewer iterations and a 64 MB bulk tensor")
    p.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    return p.parse_args(argv)


def run(args: argparse.Namespace, children: list[Child], scratch: str) -> dict:
    raw_unix = os.path.join(scratch, "raw.sock")
    raw_srv = python_child(RAW_ECHO_SERVER, raw_unix)
    children.append(raw_srv)
    zmq_srv = python_child(ZMQ_ECHO_SERVER)
    children.append(zmq_srv)
    url, token = args.url, args.token or os.environ.get("REMOTORCH_TOKEN")
    threads = args.threads or (max(1, (os.cpu_count() or 2) // 2) if url is None else None)
    if threads:
        torch.set_num_threads(threads)
    unix_url = None
    if url is None:
        token = secrets.token_hex(16)
        children.append(worker_child(args.device, token, threads))
        url = children[-1].value
        if hasattr(socket, "AF_UNIX"):
            children.append(worker_child(args.device, token, threads, os.path.join(scratch, "worker.sock")))
            unix_url = children[-1].value
        children.append(worker_child(args.device, token, threads, spin_us=SPIN_US))
        spin_url = children[-1].value
    raw_port = int(raw_srv.value)
    unix_session = remotorch.Session(unix_url, token=token) if unix_url else None
    spin_session = remotorch.Session(spin_url, token=token, spin_us=SPIN_US) if args.url is None else None
    with remotorch.Session(url, token=token) as session:
        info = session.health()
        print(f"remotorch overhead benchmark ({source_version()}): torch {torch.__version__}, "
              f"python {platform.python_version()}, "
              f"{os.cpu_count()} CPUs, {torch.get_num_threads()} intra-op threads here; worker {url} "
              f"({f'spawned, {threads} threads' if args.url is None else 'given'}) on {info['device']}")
        latency = measure_latency(session, raw_port, int(zmq_srv.value), args.quick,
                                  unix_session, raw_unix if unix_session else None, spin_session)
        for extra in (unix_session, spin_session):
            if extra is not None:
                extra.close()
        results = {"worker": {"url": url, "device": info["device"], "threads": threads},
                   "client_threads": torch.get_num_threads(), "latency": latency}
        results |= print_latency(latency)
        results |= print_wire(latency["wire"])
        results["bulk"] = measure_bulk(session, raw_port, int(zmq_srv.value), 64 if args.quick else 256,
                                       repeats=3 if args.quick else 5)
        results |= print_bulk(results["bulk"])
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    children: list[Child] = []
    start = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="remotorch-bench-")
    try:
        results = run(args, children, scratch)
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - start
    print(f"\ntotal wall time {results['wall_s']:.1f} s")
    missed = missed_targets(results)
    print("all targets met" if not missed else f"FAIL: missed {', '.join(missed)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if missed else 0


def missed_targets(results: dict) -> list[str]:
    """The targets this run missed, by name (wrong results already stopped it with an AssertionError)."""
    checks = {"overhead ratio": results["overhead_pass"], "wire bytes": results["wire_pass"],
              "bulk ratio": results["bulk_pass"]}
    if "spin_overhead_ratio" in results:
        checks["spinning overhead ratio"] = results["spin_overhead_ratio"] <= OVERHEAD_TARGET
    return [name for name, ok in checks.items() if not ok]


if __name__ == "__main__":
    sys.exit(main())
