"""The peer servers of ``benchmarks/peers.py``, each holding every model, one intra-op thread.

Run as ``python -m _peers.servers KIND [ARG]`` with the ``benchmarks`` folder
on ``PYTHONPATH``; every server exits when its standard input closes (so it
never outlives the benchmark, even one that was killed), and prints one ready
line on standard output.

- ``floor``: raw TCP. A connection first sends one byte, the model's index in
  ``NAMES``; from then on it sends the model's input bytes and gets its
  output bytes back, fixed sizes, no framing, no authentication. The input
  is received into one reused buffer and read with ``torch.frombuffer``.
  Ready line: the port.
- ``zmq``: pickle over pyzmq REQ/REP, the seed pattern done fast: one
  ``(name, array)`` message pickled with protocol 5, the tensor bytes out of
  band as their own zero-copy frames (a plain ``pickle.dumps(tensor)`` goes
  through ``torch.save`` and costs about 180 µs more per 98 KB each way
  here). It unpickles whatever it is sent. Ready line: the port.
- ``rpc PORT``: rank 1 ("server") of a torch.distributed.rpc group of two
  whose rank 0 (the benchmark) hosts the store at 127.0.0.1:PORT; the
  benchmark ``rpc.remote``\\ s the models here. Ready line: ``joined``.

:class:`ModelActor` is the Ray actor (the benchmark starts it).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import warnings

import torch

from _peers.models import NAMES, build_module, example_input


def _exit_when_stdin_closes() -> None:
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()


def _fill(conn: socket.socket, view: memoryview) -> bool:
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            return False
        got += k
    return True


def _serve_floor_connection(conn: socket.socket, models: dict) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(1)
    if not _fill(conn, memoryview(head)):
        return
    name = NAMES[head[0]]
    model, example = models[name], example_input(name)
    buf = bytearray(example.numel() * example.element_size())
    view = memoryview(buf)
    x = torch.frombuffer(buf, dtype=example.dtype).view(example.shape)  # aliases buf
    with torch.no_grad():
        while _fill(conn, view):
            y = model(x).contiguous()
            conn.sendall(memoryview(y.numpy()).cast("B"))


def serve_floor() -> None:
    """Raw TCP: input bytes in, ``torch.frombuffer``, the model, output bytes out."""
    models = {n: build_module(n) for n in NAMES}
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve_floor_connection, args=(conn, models), daemon=True).start()


def pack(obj) -> list:
    """``obj`` pickled with protocol 5: the pickle, then each out-of-band buffer as its own frame."""
    buffers: list = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return [head, *(b.raw() for b in buffers)]


def unpack(frames: list):
    """The object :func:`pack` sent (zero-copy frames from ``recv_multipart(copy=False)``)."""
    return pickle.loads(frames[0].buffer, buffers=[f.buffer for f in frames[1:]])


def serve_zmq() -> None:
    """Pickle over pyzmq REQ/REP: ``(name, array)`` in, the output array back."""
    import zmq

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    models = {n: build_module(n) for n in NAMES}
    sock = zmq.Context().socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    with torch.no_grad():
        while True:
            name, x = unpack(sock.recv_multipart(copy=False))
            y = models[name](torch.from_numpy(x))
            sock.send_multipart(pack(y.numpy()), copy=False)


def serve_rpc(port: int) -> None:
    """Join the RPC group as rank 1 and serve until rank 0 shuts it down."""
    from torch.distributed import rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120)
    rpc.init_rpc("server", rank=1, world_size=2, rpc_backend_options=opts)
    print("joined", flush=True)
    rpc.shutdown()  # waits for rank 0's shutdown: until then it serves


class ModelActor:
    """The Ray actor: holds every model (one process, as each peer server), runs the named one."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.models = {n: build_module(n) for n in NAMES}

    def forward(self, name: str, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.models[name](x)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    _exit_when_stdin_closes()
    kind = argv[0]
    if kind == "floor":
        serve_floor()
    elif kind == "zmq":
        serve_zmq()
    elif kind == "rpc":
        serve_rpc(int(argv[1]))
    else:
        raise SystemExit(f"unknown server {kind!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
