"""The peers of ``benchmarks/wan.py``, each running the training step (and the MLP) on a server process.

- **pickle/zmq**, the seed pattern: REQ/REP, one request per graph (forward,
  backward, optimizer step), through a ``DelayProxy``. Its code blocks on
  every request, so reading the loss less often changes nothing.
- **torch RPC** (TensorPipe), the step moved by hand into one function on the
  server: ``rpc_sync`` per step; ``rpc_async`` with 4 steps in flight (each
  loss read 3 steps later); ``rpc_async`` 10 steps at a time, the last loss
  read. Through a ``DelayProxy`` too: rank 0 hosts the rendezvous store
  behind a small wrapper that, when rank 0's agent looks up the server's
  TensorPipe address, answers the proxy's instead (pointing the proxy at
  the real one). Only the ``uv`` (TCP) transport and the ``basic`` channel
  are enabled on both ranks: the shared-memory transport and the CMA
  channel (which reads tensors straight out of the other process's memory)
  would bypass the proxy, and the multiplexed ``mpt_uv`` channel opens
  lanes to addresses of its own.
- **Ray**: an actor with one method per step (``ray.get`` each step; or ten
  ``.remote()`` calls and one ``ray.get``). Ray's traffic (driver, raylet,
  GCS, object store, gRPC between core workers) is many connections on
  addresses Ray picks, so it is not proxied: it is timed on loopback and
  ``RTT x round trips the code waits for`` (one per ``ray.get``) is added.
  A modelled figure, labelled so; it assumes Ray pipelines actor calls
  that are not waited for, as it does on loopback.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
from functools import partial

import torch

from _wan import workload as w
from _wan.timing import Unit, loss_diff, same

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RPC_IN_FLIGHT = 4


class Child:
    """A peer server (``python -m _wan.servers KIND``) that exits when its stdin closes."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([BENCH_DIR, os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "_wan.servers", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        self.name = args[0]

    def ready(self, timeout: float = 120.0) -> str:
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


class Counted:
    """Requests a peer's client sent and the round trips its code waited for."""

    def __init__(self) -> None:
        self.requests = 0
        self.waits = 0

    def __call__(self) -> dict:
        return {"blocking_reads": self.waits, "requests": self.requests}


def _local_pair():
    ref = w.gpt2()
    return ref, torch.optim.AdamW(ref.parameters(), lr=w.LR)


def _ten(bs, i):
    return [bs[(10 * i + j) % len(bs)] for j in range(10)]


# ----------------------------------------------------------------------------- pickle/zmq
class ZmqPeer:
    """The seed pattern's client: one REQ/REP request per graph, through ``proxy``."""

    system = "pickle/zmq"

    def __init__(self, stack: contextlib.ExitStack, make_proxy) -> None:
        import zmq

        from _peers.servers import pack, unpack
        self._pack, self._unpack = pack, unpack
        server = Child("zmq")
        stack.callback(server.stop)
        self.proxy = make_proxy(("127.0.0.1", int(server.ready())))
        self.ctx = zmq.Context()
        stack.callback(lambda: self.ctx.destroy(linger=0))
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.connect(self.proxy.url)
        self.counted = Counted()

    def call(self, op: str, arg: torch.Tensor | None = None):
        self.counted.requests += 1
        self.counted.waits += 1
        self.sock.send_multipart(self._pack((op, None if arg is None else arg.numpy())), copy=False)
        out = self._unpack(self.sock.recv_multipart(copy=False))
        return None if out is None else torch.from_numpy(out)

    def _step(self, b: torch.Tensor) -> torch.Tensor:
        loss = self.call("forward", b)
        self.call("backward")
        self.call("step")
        return loss

    def units(self, names) -> list[Unit]:
        bs, (ref, ref_opt) = w.batches(), _local_pair()
        net, x = w.mlp(), w.mlp_input()
        mk = partial(Unit, system=self.system, counters=self.counted, proxies=[self.proxy])
        out = []
        if "train" in names:
            out.append(mk(case="train", per=1, remote=lambda i: self._step(bs[i % len(bs)]).item(),
                          local=lambda i: w.train_step(ref, ref_opt, bs[i % len(bs)]), check=loss_diff))
        if "train10" in names:
            out.append(mk(case="train10", per=10, remote=lambda i: [self._step(b) for b in _ten(bs, i)][-1].item(),
                          local=lambda i: w.train_steps_read_once(ref, ref_opt, _ten(bs, i)), check=loss_diff,
                          scale=0.2))
        if "infer" in names:
            out.append(mk(case="infer", per=1, remote=lambda i: self.call("infer", x).argmax(-1).tolist(),
                          local=lambda i: w.infer(net, x), check=same))
        return out


# ------------------------------------------------------------------------------ torch RPC
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redirecting_store(inner, proxy):
    """A c10d ``Store`` over ``inner`` that answers the proxy's address for the server's TensorPipe address."""
    import torch.distributed as dist

    class RedirectStore(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.redirected = False

        def get(self, key):
            value = inner.get(key)
            if key.endswith("/addrs/server"):  # TensorPipe's address of the worker named "server"
                scheme, addr = bytes(value).decode().split("://")
                host, port = addr.rsplit(":", 1)
                proxy.aim(host, int(port))
                self.redirected = True
                return f"{scheme}://127.0.0.1:{proxy.port}".encode()
            return value

        def set(self, key, value):
            return inner.set(key, value)

        def add(self, key, n):
            return inner.add(key, n)

        def compare_set(self, key, expected, desired):
            return inner.compare_set(key, expected, desired)

        def wait(self, keys, timeout=None):
            return inner.wait(keys) if timeout is None else inner.wait(keys, timeout)

        def check(self, keys):
            return inner.check(keys)

        def delete_key(self, key):
            return inner.delete_key(key)

        def num_keys(self):
            return inner.num_keys()

        def set_timeout(self, timeout):
            return inner.set_timeout(timeout)

    return RedirectStore()


class RpcPeer:
    """torch RPC's client (rank 0), its calls to the server going through a ``DelayProxy``."""

    system = "torch RPC"

    def __init__(self, stack: contextlib.ExitStack, make_proxy) -> None:
        import torch.distributed as dist
        from torch.distributed import rpc

        from _wan.servers import RPC_TRANSPORT
        self.rpc = rpc
        port = _free_port()
        self.proxy = make_proxy(("127.0.0.1", 1))  # aimed at the server once its address is known
        scheme = f"wanproxy{secrets.token_hex(4)}"
        made = []

        def rendezvous(url, **kwargs):
            inner = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=120))
            made.append(_redirecting_store(inner, self.proxy))
            yield made[-1], 0, 2
        dist.register_rendezvous_handler(scheme, rendezvous)
        self.server = Child("rpc", str(port))
        stack.callback(self.server.stop)
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"{scheme}://", rpc_timeout=300, **RPC_TRANSPORT)
        rpc.init_rpc("client", rank=0, world_size=2, rpc_backend_options=opts)
        stack.callback(lambda: rpc.shutdown(graceful=self.server.proc.poll() is None))
        self.server.ready()
        if not made[0].redirected:
            raise RuntimeError("torch RPC did not look up the server's address: its calls would bypass the proxy")
        self.counted = Counted()
        self.seq = 0
        self.inflight: collections.deque = collections.deque()

    def _async(self, b: torch.Tensor):
        from _wan.servers import rpc_whole_step

        self.counted.requests += 1
        fut = self.rpc.rpc_async("server", rpc_whole_step, args=(self.seq, b))
        self.seq += 1
        return fut

    def _wait(self, fut):
        self.counted.waits += 1
        return fut.wait()

    def _pipelined(self, b: torch.Tensor):
        """Issue a step; with RPC_IN_FLIGHT steps in flight, read the oldest one's loss."""
        fut = self._async(b)
        self.inflight.append(fut)
        if len(self.inflight) >= RPC_IN_FLIGHT:
            self._wait(self.inflight.popleft())
        return fut

    def _drain(self) -> None:
        while self.inflight:
            self._wait(self.inflight.popleft())

    def units(self, names) -> list[Unit]:
        from _wan.servers import rpc_infer

        bs, (ref, ref_opt) = w.batches(), _local_pair()
        net, x = w.mlp(), w.mlp_input()
        mk = partial(Unit, counters=self.counted, proxies=[self.proxy])
        local = lambda i: w.train_step(ref, ref_opt, bs[i % len(bs)])  # noqa: E731
        out = []
        if "train" in names:
            out.append(mk(case="train", system="torch RPC rpc_sync", per=1, local=local, check=loss_diff,
                          remote=lambda i: self._wait(self._async(bs[i % len(bs)]))))
            out.append(mk(case="train", system=f"torch RPC rpc_async x{RPC_IN_FLIGHT}", per=1, local=local,
                          remote=lambda i: self._pipelined(bs[i % len(bs)]), sync=self._drain,
                          lead=RPC_IN_FLIGHT - 1,
                          check=lambda fut, loc: loss_diff(fut.wait(), loc),
                          note=f"{RPC_IN_FLIGHT} steps in flight: each loss read {RPC_IN_FLIGHT - 1} steps later"))
        if "train10" in names:
            out.append(mk(case="train10", system="torch RPC rpc_async x10", per=10, scale=0.5,
                          remote=lambda i: self._wait([self._async(b) for b in _ten(bs, i)][-1]),
                          local=lambda i: w.train_steps_read_once(ref, ref_opt, _ten(bs, i)), check=loss_diff))
        if "infer" in names:
            def infer(i):
                self.counted.requests += 1
                self.counted.waits += 1
                return self.rpc.rpc_sync("server", rpc_infer, args=(x,)).argmax(-1).tolist()
            out.append(mk(case="infer", system="torch RPC rpc_sync", per=1, remote=infer,
                          local=lambda i: w.infer(net, x), check=same))
        return out

    def pids(self) -> dict:
        return {"rank 0 (this process)": os.getpid(), "rank 1 (server)": self.server.proc.pid}


# ------------------------------------------------------------------------------------ Ray
class RayPeer:
    """A Ray actor holding the step; timed on loopback, the RTT added per ``ray.get`` (modelled)."""

    system = "Ray (modelled)"

    def __init__(self, stack: contextlib.ExitStack) -> None:
        import ray

        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # token auth on, none written to $HOME
        path = os.pathsep.join([BENCH_DIR, os.environ.get("PYTHONPATH", "")])  # packages set up beside the venv too
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 << 20,
                 log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
        stack.callback(ray.shutdown)
        self.ray = ray
        self.actor = ray.remote(w.StepServer).options(num_cpus=0).remote()
        self.counted = Counted()
        self.seq = 0

    def _submit(self, b: torch.Tensor):
        self.counted.requests += 1
        ref = self.actor.whole_step.remote(self.seq, b)
        self.seq += 1
        return ref

    def _get(self, ref):
        self.counted.waits += 1
        return self.ray.get(ref)

    def units(self, names) -> list[Unit]:
        bs, (ref, ref_opt) = w.batches(), _local_pair()
        net, x = w.mlp(), w.mlp_input()
        mk = partial(Unit, system=self.system, counters=self.counted, waits=1.0)
        out = []
        if "train" in names:
            out.append(mk(case="train", per=1, remote=lambda i: self._get(self._submit(bs[i % len(bs)])),
                          local=lambda i: w.train_step(ref, ref_opt, bs[i % len(bs)]), check=loss_diff))
        if "train10" in names:
            out.append(mk(case="train10", per=10, scale=0.5,
                          remote=lambda i: self._get([self._submit(b) for b in _ten(bs, i)][-1]),
                          local=lambda i: w.train_steps_read_once(ref, ref_opt, _ten(bs, i)), check=loss_diff))
        if "infer" in names:
            def infer(i):
                self.counted.requests += 1
                return self._get(self.actor.infer.remote(x)).argmax(-1).tolist()
            out.append(mk(case="infer", per=1, remote=infer, local=lambda i: w.infer(net, x), check=same))
        return out
