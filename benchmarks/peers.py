"""remotorch against what a user would pick instead, and against the floor, in one run.

Three models, each resident in a second process and called from this one
(``benchmarks/_peers/models.py`` builds them from a fixed seed in every
process): the seed MLP (784-256-10, batch 32), a transformer block (8 x 32
tokens x width 64) and an HF GPT-2 forward (``GPT2LMHeadModel``, n_layer=4,
n_embd=256, n_head=4, vocabulary 8192, batch 1 x 32 tokens, returning the
logits), all without gradients. The systems:

- **local**: the model in this process.
- **floor**: a minimal Python server on a raw TCP socket: the input's raw
  bytes in, ``torch.frombuffer``, the model, the output's raw bytes out; no
  framing beyond fixed sizes, no authentication. What moving the bytes and
  computing costs.
- **floor compiled** (a diagnostic, not a peer): the floor called through
  ``torch.compile`` with a backend that only sends the graph's input to the
  floor server and returns its reply. It is what torch.compile's own
  per-call runtime (Dynamo's guards, the frame, gathering the parameters as
  graph inputs) adds to the floor, with nothing of remotorch in it: the part
  of remotorch's overhead that any ``torch.compile`` backend pays. It has a
  floor server process of its own (every system has its own copy of the
  weights): its turn follows the floor's in every round, and on a shared
  server it would find the weights still in the caches the floor's turn
  warmed.
- **pickle/zmq**: pickle over pyzmq REQ/REP, done fast (protocol 5, tensor
  bytes as zero-copy out-of-band frames); it unpickles whatever it is sent.
- **torch RPC**: ``torch.distributed.rpc`` over loopback (world size 2, the
  server is rank 1, TensorPipe with its default transports): ``rpc.remote``
  builds the module there once (an RRef), then ``rref.rpc_sync().forward(x)``.
  It is measured in a phase of its own, after the others, with the same
  rounds: TensorPipe's threads busy-poll for as long as the group is up, in
  both ranks (about one CPU each while no call is made, which the script
  measures and prints), so while it is up every other system runs on a
  machine with its CPUs taken. The group starts only after the other
  systems' runs.
- **Ray**: a local Ray (2 CPUs, no dashboard, token authentication on), one
  actor holding the models: ``ray.get(actor.forward.remote(name, x))``.
- **remotorch**: ``remotorch.compile(model, fallback="raise")`` on a
  ``remotorch serve`` worker over ``tcp://`` and over ``unix://`` with the
  defaults (both ends busy-poll ``auto``: up to 1 ms while calls come back
  to back), and over ``tcp://`` with a fixed window on both ends
  (``serve --spin-us``, ``Session(spin_us=)``; ``--spin-us``, default 0:
  polling off, so the run shows what ``auto`` buys); and over ``tcp://`` on a
  worker serving Prometheus metrics (``serve --metrics``), so the run shows
  what counting every request costs a warm call.

Every process does its intra-op work on one thread (``torch.set_num_threads(1)``,
``--threads 1``). Calls are timed one by one in interleaved rounds: within each
round every system takes its turn, in an order shuffled from round to round
(seeded: the same every run), so the machine's noise hits all alike and no
system always follows the same other (whose leftover work or warm caches
would then always be its neighbour's); torch RPC has its own rounds, above.
Each system's output is
checked against the local model's (``allclose``) before timing and after each
round, and must be an ordinary tensor in this process (remotorch's output is
read, so it comes back rather than staying on the worker): no system is fast
because it is wrong or because it skipped the bytes. A remotorch call is sent
without waiting and returns a placeholder at once (only a read waits), so
its timed call is the call and the read of its output (``materialize_()``,
the least a user who uses the value does): the time until the value is in
hand, as every other system's call returns it.

Printed per model: each system's median and p99 (µs) and its ratio to local
(for remotorch also the worker's own mean graph time, from ``Session.stats()``);
for information, the median of each turn's first call, which runs after the
other systems' turns with its code and data out of the caches (one call in
``calls per round``: with 25, 4% of the calls, so the p99 is one of them),
and the p99 of the other calls;
remotorch / best peer (the best of pickle/zmq, torch RPC and Ray) and
(remotorch - local) / (floor - local); and how much of the gap to the
floor is torch.compile's own (floor compiled / floor). Targets (the hot-path
issue, 26), judged on remotorch over TCP, on the median of the runs' values
(``--runs 3``). "Floor compiled" is the fair floor for remotorch's own share:
what any ``torch.compile`` backend pays is in it too.

- MLP: remotorch <= 1.2 x floor compiled;
- GPT-2: remotorch <= 1.05 x floor compiled;
- MLP: remotorch <= 0.7 x the best peer;
- every model: remotorch's p99 <= 3 x its median;
- MLP: remotorch with ``--metrics`` <= 1.03 x without (the worker-wide
  issue, 37: metrics within noise).

(remotorch - local) / (floor - local) and remotorch / floor are printed for
information (issue 14's measures).

The bulk and wire-bytes targets are ``benchmarks/overhead.py``'s (it says
where); this script does not re-measure them. Exit status: 0 when every
target is met, 1 when one is missed; an error (a wrong output, a peer that
does not start) raises. Every process it starts is stopped on the way out,
on failure and Ctrl-C too.

Usage::

    python benchmarks/peers.py [--runs 3] [--quick] [--json [PATH]] [--spin-us 0]

``--json`` alone prints the figures as JSON on standard output (the report
goes to standard error); ``--json PATH`` writes them there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback only; before `import ray`

import torch  # noqa: E402
import zmq  # noqa: E402

import remotorch  # noqa: E402
from remotorch.client.embedded import spawn_worker  # noqa: E402
from remotorch.client.remote import RemoteTensor  # noqa: E402
from _peers.models import NAMES, build_module, describe, example_input  # noqa: E402
from _peers.servers import ModelActor, pack, unpack  # noqa: E402

PEERS = ("pickle/zmq", "torch RPC", "Ray")
REMOTORCH = ("remotorch tcp", "remotorch unix", "remotorch tcp spin", "remotorch tcp metrics")
SYSTEMS = ("local", "floor", "floor compiled", *PEERS, *REMOTORCH)
ALONE = "torch RPC"  # measured in a phase of its own: its threads busy-poll while the group is up
PEER_TARGET = 0.7  # remotorch / best peer, MLP, TCP
MLP_COMPILED_FLOOR_TARGET = 1.2  # remotorch / floor compiled, MLP
GPT2_COMPILED_FLOOR_TARGET = 1.05  # remotorch / floor compiled, GPT-2
TAIL_TARGET = 3.0  # p99 / median, remotorch
METRICS_TARGET = 1.03  # remotorch tcp with --metrics / without, MLP (the worker counts every request)
RTOL, ATOL = 1e-4, 1e-4
# per model: (rounds, calls per system in each round, warm-up calls per system)
FULL = {"mlp": (20, 25, 50), "block": (20, 25, 50), "gpt2": (20, 4, 5)}
QUICK = {"mlp": (3, 5, 3), "block": (3, 5, 3), "gpt2": (3, 2, 1)}
out = sys.stdout  # where the report goes (standard error under a bare --json)


def say(*args) -> None:
    print(*args, file=out, flush=True)


# ---------------------------------------------------------------------------- processes
class Child:
    """A peer server (``python -m _peers.servers KIND``) that exits when its stdin closes."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([BENCH_DIR, os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "_peers.servers", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        self.name = args[0]

    def ready(self, timeout: float = 120.0) -> str:
        """Its ready line (a port, or ``joined``); raises if it exits or stays silent."""
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not line or not line[0].strip():
            self.stderr.seek(0)
            raise RuntimeError(f"the {self.name} server did not start:\n{self.stderr.read()[-3000:]}")
        return line[0].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(stack: contextlib.ExitStack, token: str, listen: list[str], spin_us: float | None = None):
    """A real ``remotorch serve`` with one intra-op thread; stopped when ``stack`` closes."""
    args = [*listen, "--threads", "1", "--token", token, "--name", "peers", "--device", "cpu",
            "--exit-on-stdin-close"]
    if spin_us is not None:  # else the default, auto
        args += ["--spin-us", f"{spin_us:g}"]
    worker = spawn_worker(args, env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"),
                          stdin=subprocess.PIPE)
    stack.callback(worker.stop)
    return worker.url


def start_ray(stack: contextlib.ExitStack):
    """A new local Ray of our own, as the tests' ``ray_local`` fixture starts one.

    Token authentication stays on (as users get it), with a random token in
    ``RAY_AUTH_TOKEN`` so Ray writes none into the home directory; it listens
    on loopback only; ``address="local"`` never joins a cluster already running.
    """
    import ray

    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 << 20, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": BENCH_DIR, "OMP_NUM_THREADS": "1"}})
    stack.callback(ray.shutdown)
    signal.signal(signal.SIGTERM, _terminate)  # ray.init put its own in (it aborts the process)
    return ray


def start_rpc(stack: contextlib.ExitStack) -> dict:
    """Join a torch RPC group of two with a server process as rank 1; ``rpc.remote`` each model there."""
    from torch.distributed import rpc

    port = free_port()
    server = Child("rpc", str(port))
    stack.callback(server.stop)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120)
    rpc.init_rpc("client", rank=0, world_size=2, rpc_backend_options=opts)
    stack.callback(lambda: rpc.shutdown(graceful=server.proc.poll() is None))
    server.ready()
    return server, {n: rpc.remote("server", build_module, args=(n,)) for n in NAMES}


def cpu_seconds(pid: int | str) -> float | None:
    """User + system CPU seconds a process has used so far (all its threads); None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(pids: dict[str, int | str], seconds: float = 2.0) -> dict[str, float | None]:
    """CPUs each process keeps busy while nothing calls it (this thread sleeps meanwhile)."""
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    time.sleep(seconds)
    after = {k: cpu_seconds(p) for k, p in pids.items()}
    return {k: None if before[k] is None or after[k] is None else (after[k] - before[k]) / seconds for k in pids}


class Systems:
    """Every server, worker, session and client of the benchmark; :meth:`close` stops them all."""

    def __init__(self, spin_us: float) -> None:
        self.stack = contextlib.ExitStack()
        self.spin_us = spin_us
        try:
            self._start()
        except BaseException:
            self.stack.close()
            raise

    def _start(self) -> None:
        stack = self.stack
        # the floor compiled has a floor server of its own: sharing one, it would find that
        # server's weights in the caches the floor's turn just warmed
        floor, floor2, pickler = Child("floor"), Child("floor"), Child("zmq")
        stack.callback(floor.stop)
        stack.callback(floor2.stop)
        stack.callback(pickler.stop)
        token = secrets.token_hex(16)
        scratch = tempfile.mkdtemp(prefix="remotorch-peers-")
        stack.callback(lambda: (os.path.exists(sock) and os.unlink(sock), os.rmdir(scratch)))
        sock = os.path.join(scratch, "worker.sock")
        urls: dict[str, str] = {}
        starts = {"remotorch tcp": (["--host", "127.0.0.1", "--port", "0"], None),
                  "remotorch unix": (["--unix", sock], None),
                  "remotorch tcp spin": (["--host", "127.0.0.1", "--port", "0"], self.spin_us),
                  "remotorch tcp metrics": (["--host", "127.0.0.1", "--port", "0", "--metrics", "127.0.0.1:0"], None)}
        errors: list[BaseException] = []

        def spawn(name: str) -> None:
            try:
                urls[name] = start_worker(stack, token, *starts[name])
            except BaseException as exc:  # raised below, in this thread
                errors.append(exc)
        threads = [threading.Thread(target=spawn, args=(n,), daemon=True) for n in starts]
        for t in threads:
            t.start()
        self.ray = start_ray(stack)
        self.actor = self.ray.remote(ModelActor).options(num_cpus=0).remote()  # builds its models meanwhile
        self.rrefs: dict = {}
        self.floor_port, self.floor_compiled_port = int(floor.ready()), int(floor2.ready())
        self.zmq_port = int(pickler.ready())
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.sessions = {}
        for name, url in urls.items():
            spin = self.spin_us if name.endswith("spin") else None
            self.sessions[name] = stack.enter_context(remotorch.Session(url, token=token, spin_us=spin))
        self.zmq_ctx = zmq.Context()
        stack.callback(lambda: self.zmq_ctx.destroy(linger=0))

    def probes(self, name: str, model: torch.nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """One call per system running the named model on its input."""
        floor = FloorClient(self.floor_port, name, model)
        self.stack.callback(floor.close)
        floor2 = FloorClient(self.floor_compiled_port, name, model)
        self.stack.callback(floor2.close)
        req = self.zmq_ctx.socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{self.zmq_port}")
        self.stack.callback(req.close, 0)
        actor = self.actor
        probes = {"local": model, "floor": floor.call, "floor compiled": floor_compiled(model, floor2),
                  "pickle/zmq": lambda x: zmq_call(req, name, x),
                  "Ray": lambda x: self.ray.get(actor.forward.remote(name, x))}
        for system in REMOTORCH:
            probes[system] = reading(remotorch.compile(model, session=self.sessions[system], fallback="raise"))
        return probes

    def start_rpc(self) -> None:
        """Start the torch RPC group (after the other systems' runs)."""
        self.rpc_server, self.rrefs = start_rpc(self.stack)

    def rpc_idle_cpu(self) -> dict[str, float | None]:
        """The CPUs each rank of the RPC group keeps busy while no call is made."""
        return idle_cpu({"rank 0 (this process)": "self", "rank 1 (the server)": self.rpc_server.proc.pid})

    def rpc_probe(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        rref = self.rrefs[name]
        return lambda x: rref.rpc_sync().forward(x)

    def close(self) -> None:
        self.stack.close()


class FloorClient:
    """One raw TCP connection to the floor server for one model: fixed-size bytes there and back."""

    def __init__(self, port: int, name: str, model: torch.nn.Module) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(bytes([NAMES.index(name)]))
        self.out = torch.empty_like(model(example_input(name)))  # the reply lands here, call after call
        self.view = memoryview(self.out.numpy()).cast("B")

    def call(self, x: torch.Tensor) -> torch.Tensor:
        self.sock.sendall(memoryview(x.numpy()).cast("B"))
        got, n, view = 0, len(self.view), self.view
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if not k:
                raise ConnectionError("the floor server closed the connection")
            got += k
        return self.out

    def close(self) -> None:
        self.sock.close()


def floor_compiled(model: torch.nn.Module, floor: FloorClient) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model`` under ``torch.compile`` with a backend that calls the floor: the floor plus Dynamo's per-call cost.

    Dynamo hands the backend the module's parameters as graph inputs
    (``nn.Parameter``) beside the caller's one tensor; the backend sends that
    tensor to the floor server, as the floor row does, and returns the reply
    as the graph's output. One graph per model (no graph breaks), else an
    AssertionError.
    """
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        inputs = [i for i, t in enumerate(example_inputs) if type(t) is torch.Tensor]
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        if len(graphs) > 1 or len(inputs) != 1 or not isinstance(outputs, (tuple, list)) or len(outputs) != 1:
            raise AssertionError("floor compiled: the model must be one graph of one input and one output")
        (i,) = inputs
        return lambda *args: (floor.call(args[i]),)
    return torch.compile(model, backend=backend, fullgraph=True)


def reading(compiled: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A remotorch call whose output is read before it returns: the call is sent without waiting and
    its output stands here as a placeholder until read, so the read is what waits for the worker."""
    def call(x: torch.Tensor) -> torch.Tensor:
        out = compiled(x)
        if type(out) is RemoteTensor:  # else it came back already (an ordinary tensor)
            out.materialize_()
        return out
    return call


def in_hand(t) -> bool:
    """``t`` is an ordinary tensor whose data is in this process (a read placeholder keeps its class)."""
    return type(t) is torch.Tensor or (type(t) is RemoteTensor and not t.is_remote)


def zmq_call(sock, name: str, x: torch.Tensor) -> torch.Tensor:
    sock.send_multipart(pack((name, x.numpy())), copy=False)
    return torch.from_numpy(unpack(sock.recv_multipart(copy=False)))


# ---------------------------------------------------------------------------- measuring
def check(system: str, got, expected: torch.Tensor, matched: dict) -> None:
    """``got`` is an ordinary tensor here, close to the local output; else an AssertionError."""
    if not in_hand(got):
        raise AssertionError(f"{system} returned {type(got).__name__}, not a tensor in this process")
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=RTOL, atol=ATOL):
        diff = (got - expected).abs().max().item() if got.shape == expected.shape else float("nan")
        raise AssertionError(f"{system}: output differs from local (shape {tuple(got.shape)}, max |diff| {diff})")
    m = matched.setdefault(system, {"checks": 0, "max_abs_diff": 0.0})
    m["checks"] += 1
    m["max_abs_diff"] = max(m["max_abs_diff"], (got - expected).abs().max().item())


def summary(samples_ns: list[int], per_turn: int) -> dict:
    """Median and p99 of per-call samples, in microseconds; and, for information, the median of
    each turn's first call (the one after the other systems ran) and the p99 of the others."""
    s = sorted(samples_ns)
    firsts = samples_ns[::per_turn]
    rest = sorted(t for i, t in enumerate(samples_ns) if i % per_turn)
    return {"median_us": statistics.median(s) / 1e3, "p99_us": _p99(s) / 1e3, "n": len(s),
            "first_of_turn_median_us": statistics.median(firsts) / 1e3,
            "p99_after_first_us": _p99(rest) / 1e3 if rest else None}


def _p99(s: list[int]) -> int:
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def interleaved(probes: dict, x: torch.Tensor, expected: torch.Tensor, plan: tuple[int, int, int],
                matched: dict) -> dict[str, dict]:
    """Warm each system up, then time call by call in rounds that shuffle the order of the systems."""
    rounds, per_round, warmup = plan
    order = random.Random(26)
    for system, fn in probes.items():
        for _ in range(warmup):
            fn(x)
        check(system, fn(x), expected, matched)
    names = list(probes)
    samples: dict[str, list[int]] = {n: [] for n in names}
    clock = time.perf_counter_ns
    for _ in range(rounds):
        turns = names[:]
        order.shuffle(turns)
        for system in turns:
            fn, times = probes[system], samples[system]
            for _ in range(per_round):
                t0 = clock()
                got = fn(x)
                times.append(clock() - t0)
            check(system, got, expected, matched)
    return {n: summary(samples[n], per_round) for n in names}


def ratios(rows: dict[str, dict]) -> dict:
    """The issue's ratios for one model's rows: against the best peer, the floor and local."""
    med = {s: r["median_us"] for s, r in rows.items()}
    best = min(PEERS, key=lambda s: med[s])
    floor_extra = med["floor"] - med["local"]
    out = {"best_peer": best, "best_peer_us": med[best], "compiled_floor_vs_floor": med["floor compiled"] / med["floor"]}
    for system in REMOTORCH:
        # None where the floor measured no slower than local (compute-bound GPT-2, noise): no ratio
        out[system] = {"vs_best_peer": med[system] / med[best],
                       "overhead_vs_floor_overhead": (med[system] - med["local"]) / floor_extra
                       if floor_extra > 0 else None,
                       "vs_floor": med[system] / med["floor"],
                       "vs_compiled_floor": med[system] / med["floor compiled"],
                       "p99_over_median": rows[system]["p99_us"] / med[system]}
    return out


def measure(systems: Systems, prepared: dict, plans: dict, matched: dict) -> dict:
    """One run of every system but torch RPC: every model, interleaved; the rows per model."""
    run = {}
    with torch.no_grad():
        for name in NAMES:
            probes, x, expected = prepared[name]
            before = {s: systems.sessions[s].stats() for s in REMOTORCH}
            rows = interleaved(probes, x, expected, plans[name], matched.setdefault(name, {}))
            for s in REMOTORCH:  # the worker's own graph time, from the session's counters
                after = systems.sessions[s].stats()
                calls = after["remote_calls"] - before[s]["remote_calls"]
                rows[s]["worker_graph_mean_us"] = (after["remote_ms"] - before[s]["remote_ms"]) / calls * 1e3
            run[name] = {"rows": rows}
    return run


def measure_alone(probes: dict, runs: list[dict], plans: dict, matched: dict) -> None:
    """torch RPC's own phase: as many runs as the others had, the same rounds, its rows added to each run."""
    with torch.no_grad():
        for run in runs:
            for name in NAMES:
                fn, x, expected = probes[name]
                run[name]["rows"].update(interleaved({ALONE: fn}, x, expected, plans[name],
                                                     matched.setdefault(name, {})))


def finish(run: dict) -> dict:
    """A run's rows in the order of SYSTEMS, each with its ratio to local; the ratios per model."""
    for name in NAMES:
        rows = run[name]["rows"] = {s: run[name]["rows"][s] for s in SYSTEMS}
        for r in rows.values():
            r["vs_local"] = r["median_us"] / rows["local"]["median_us"]
        run[name]["ratios"] = ratios(rows)
    return run


def prepare(systems: Systems) -> dict:
    """Each model with its probes, input and local output; every system checked once (compiles, uploads)."""
    prepared = {}
    with torch.no_grad():
        for name in NAMES:
            model, x = build_module(name), example_input(name)
            expected = model(x).clone()
            probes = systems.probes(name, model)
            for system, fn in probes.items():
                first_check(system, fn, x, expected)
            prepared[name] = (probes, x, expected)
    return prepared


def prepare_alone(systems: Systems, prepared: dict) -> dict:
    """torch RPC's probe per model (the group is started here), each checked once."""
    systems.start_rpc()
    probes = {}
    with torch.no_grad():
        for name in NAMES:
            _, x, expected = prepared[name]
            fn = systems.rpc_probe(name)
            first_check(ALONE, fn, x, expected)
            probes[name] = (fn, x, expected)
    return probes


def first_check(system: str, fn, x: torch.Tensor, expected: torch.Tensor) -> None:
    # the first output is read here, as a user reads it: from then on remotorch sends
    # it back with each call instead of keeping it on the worker
    first = fn(x)
    if not torch.allclose(first, expected, rtol=RTOL, atol=ATOL):
        raise AssertionError(f"{system}: first output differs from local")
    check(system, fn(x), expected, {})


# ------------------------------------------------------------------------------ report
def print_run(i: int, run: dict, spin_us: float) -> None:
    say(f"\nRun {i + 1}")
    say(f"  {'system':24s} {'model':6s} {'median µs':>10s} {'p99 µs':>10s} {'x local':>8s} {'p99/med':>8s} "
        f"{'1st of turn':>11s} {'p99 rest':>9s} {'worker graph µs':>16s}")
    for name in NAMES:
        for system, r in run[name]["rows"].items():
            label = system.replace("spin", f"spin {spin_us:g}µs" if spin_us else "no polling")
            graph = f"{r['worker_graph_mean_us']:16.1f}" if "worker_graph_mean_us" in r else ""
            rest = "" if r["p99_after_first_us"] is None else f"{r['p99_after_first_us']:9.1f}"
            say(f"  {label:24s} {name:6s} {r['median_us']:10.1f} {r['p99_us']:10.1f} {r['vs_local']:8.2f} "
                f"{r['p99_us'] / r['median_us']:8.2f} {r['first_of_turn_median_us']:11.1f} {rest:>9s} {graph}")
        say("")
    for name in NAMES:
        rt = run[name]["ratios"]
        say(f"  {name}: best peer {rt['best_peer']} ({rt['best_peer_us']:.1f} µs); "
            f"floor compiled / floor {rt['compiled_floor_vs_floor']:.2f}")
        for system in REMOTORCH:
            q = rt[system]
            over = q["overhead_vs_floor_overhead"]
            say(f"    {system:20s} / best peer {q['vs_best_peer']:5.2f}   (- local) / (floor - local) "
                f"{'n/a' if over is None else f'{over:.2f}':>6s}   / floor {q['vs_floor']:5.2f}   "
                f"/ floor compiled {q['vs_compiled_floor']:5.2f}")


def judge(runs: list[dict]) -> list[dict]:
    """The targets, each on the median of the runs' values of remotorch over TCP."""
    def target(label: str, values: list, limit: float) -> dict:
        # a run whose floor was no slower than local gives no overhead ratio: it counts as a miss
        value = statistics.median(float("inf") if v is None else v for v in values)
        return {"name": label, "per_run": values, "value": value if math.isfinite(value) else None,
                "limit": limit, "pass": value <= limit}
    rt = "remotorch tcp"
    targets = [
        target("MLP: remotorch / floor compiled", [r["mlp"]["ratios"][rt]["vs_compiled_floor"] for r in runs],
               MLP_COMPILED_FLOOR_TARGET),
        target("GPT-2: remotorch / floor compiled", [r["gpt2"]["ratios"][rt]["vs_compiled_floor"] for r in runs],
               GPT2_COMPILED_FLOOR_TARGET),
        target("MLP: remotorch / best peer", [r["mlp"]["ratios"][rt]["vs_best_peer"] for r in runs], PEER_TARGET),
        target("MLP: remotorch with --metrics / without",
               [r["mlp"]["rows"]["remotorch tcp metrics"]["median_us"] / r["mlp"]["rows"][rt]["median_us"]
                for r in runs], METRICS_TARGET)]
    for name in NAMES:
        targets.append(target(f"{name}: remotorch p99 / median",
                              [r[name]["ratios"][rt]["p99_over_median"] for r in runs], TAIL_TARGET))
    return targets


def print_targets(targets: list[dict], n_runs: int) -> None:
    say(f"\nTargets (remotorch over TCP; the median of {n_runs} run{'s' * (n_runs > 1)}):")
    for t in targets:
        runs = ", ".join("n/a" if v is None else f"{v:.2f}" for v in t["per_run"])
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        say(f"  {t['name']:46s} {value:>6s}  (target <= {t['limit']:g}; runs {runs})  "
            f"{'PASS' if t['pass'] else 'FAIL'}")
    say("  bulk (256 MB round trip >= 0.8 x raw TCP) and wire bytes per warm call (<= tensors + 1 KiB):\n"
        "    not re-measured here; benchmarks/overhead.py measures both and exits 1 on a miss")


def shares(runs: list[dict]) -> dict:
    """Per model, the median over runs of torch.compile's share (floor compiled / floor) and of remotorch's own."""
    rt = "remotorch tcp"
    return {name: {"compiled_floor_vs_floor": statistics.median(r[name]["ratios"]["compiled_floor_vs_floor"]
                                                                 for r in runs),
                   "remotorch_vs_compiled_floor": statistics.median(r[name]["ratios"][rt]["vs_compiled_floor"]
                                                                     for r in runs)}
            for name in NAMES}


def print_shares(share: dict) -> None:
    say("\nWhose overhead (no targets; the median of the runs):")
    for name, q in share.items():
        say(f"  {name:6s} floor compiled / floor {q['compiled_floor_vs_floor']:5.2f} (torch.compile's own per-call "
            f"cost)   remotorch tcp / floor compiled {q['remotorch_vs_compiled_floor']:5.2f} (remotorch's)")


# -------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1, help="repeat the whole measurement; targets judge the median")
    p.add_argument("--quick", action="store_true", help="a smoke test: a few calls per system, one run")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write every figure as JSON to PATH (alone: to standard output, the report to stderr)")
    p.add_argument("--spin-us", type=float, default=0.0,
                   help="fixed busy-poll window of the third remotorch pair (default 0: polling off, "
                        "against the other two's default, auto)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    return args


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    global out
    args = parse_args(argv)
    if args.json == "-":
        out = sys.stderr
    runs_n, plans = (1, QUICK) if args.quick else (args.runs, FULL)
    signal.signal(signal.SIGTERM, _terminate)  # a killed benchmark still stops what it started
    torch.set_num_threads(1)
    start = time.perf_counter()
    systems = Systems(args.spin_us)
    try:
        say(f"remotorch peer benchmark: remotorch {remotorch.__version__}, torch {torch.__version__}, "
            f"python {platform.python_version()}, {os.cpu_count()} CPUs, one intra-op thread per process")
        for name in NAMES:
            say(f"  {name}: {describe(name)}; {plans[name][0]} rounds x {plans[name][1]} calls per system")
        t_started = time.perf_counter()
        prepared = prepare(systems)
        say(f"  started every system in {t_started - start:.1f} s; compiled, uploaded and checked in "
            f"{time.perf_counter() - t_started:.1f} s")
        matched: dict = {}
        runs = []
        for i in range(runs_n):
            runs.append(measure(systems, prepared, plans, matched))
            say(f"  run {i + 1} of {runs_n}: every system but {ALONE} measured")
        alone = prepare_alone(systems, prepared)
        busy = systems.rpc_idle_cpu()
        measure_alone(alone, runs, plans, matched)
        say(f"  {ALONE}, alone afterwards: its ranks keep "
            + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in busy.items())
            + " CPUs busy while no call is made")
        for i, run in enumerate(runs):
            print_run(i, finish(run), args.spin_us)
    finally:
        systems.close()
    targets = judge(runs)
    print_targets(targets, runs_n)
    share = shares(runs)
    print_shares(share)
    passed = all(t["pass"] for t in targets)
    wall = time.perf_counter() - start
    say(f"\ntotal wall time {wall:.1f} s; " + ("all targets met" if passed else
        "FAIL: missed " + "; ".join(t["name"] for t in targets if not t["pass"])))
    result = {"systems": list(SYSTEMS), "models": {n: describe(n) for n in NAMES}, "spin_us": args.spin_us,
              "quick": args.quick, "plans": plans, "runs": runs, "rpc_idle_cpus": busy, "matched": matched,
              "targets": targets, "shares": share,
              "passed": passed, "bulk_and_wire": "benchmarks/overhead.py", "wall_s": wall}
    if args.json == "-":
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
