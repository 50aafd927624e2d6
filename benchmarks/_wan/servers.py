"""The peers' server side for ``benchmarks/wan.py``: each holds :class:`~_wan.workload.StepServer`.

Run as ``python -m _wan.servers KIND [ARG]`` with the ``benchmarks`` folder on
``PYTHONPATH``; a server exits when its standard input closes and prints one
ready line on standard output. One intra-op thread per process.

- ``zmq``: pickle over pyzmq REQ/REP, the seed pattern called per graph:
  ``("forward", batch)`` runs the forward and answers the loss,
  ``("backward", None)`` and ``("step", None)`` (the optimizer's step and
  ``zero_grad``) answer ``None``; ``("infer", x)`` answers the MLP's output.
  It unpickles whatever it is sent. Ready line: the port.
- ``rpc PORT``: rank 1 ("server") of a torch RPC group of two whose rank 0
  (the benchmark) hosts the store at 127.0.0.1:PORT, TensorPipe on its TCP
  transport (``uv``) and ``basic`` channel only, so every byte goes over the
  one address rank 0 connects to (the benchmark's proxy). Rank 0 calls the
  ``rpc_*`` functions below. Ready line: ``joined``.

Ray runs :class:`~_wan.workload.StepServer` as its actor (the benchmark starts it).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings

import torch

from _peers.servers import pack, unpack
from _wan.workload import StepServer

RPC_TRANSPORT = dict(_transports=["uv"], _channels=["basic"])
_server: StepServer | None = None
_made = threading.Lock()


def _state() -> StepServer:
    global _server
    with _made:
        if _server is None:
            _server = StepServer()
        return _server


def rpc_whole_step(seq: int, b: torch.Tensor) -> float:
    """torch RPC: one whole training step (the ``seq``-th, counted from 0); its loss."""
    return _state().whole_step(seq, b)


def rpc_infer(x: torch.Tensor) -> torch.Tensor:
    return _state().infer(x)


def serve_zmq() -> None:
    """Pickle over pyzmq REQ/REP, one request per graph (see the module docstring)."""
    import zmq

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    server = StepServer()
    sock = zmq.Context().socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    calls = {"forward": server.forward, "backward": lambda _: server.backward(), "step": lambda _: server.step(),
             "infer": server.infer}
    while True:
        op, arg = unpack(sock.recv_multipart(copy=False))
        out = calls[op](arg if arg is None else torch.from_numpy(arg))
        sock.send_multipart(pack(None if out is None else out.numpy()), copy=False)


def serve_rpc(port: int) -> None:
    """Join the RPC group as rank 1 and serve until rank 0 shuts it down."""
    from torch.distributed import rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=300, **RPC_TRANSPORT)
    rpc.init_rpc("server", rank=1, world_size=2, rpc_backend_options=opts)
    # built now, in the module the calls name (run with -m, this file is also __main__)
    importlib.import_module("_wan.servers")._state()
    print("joined", flush=True)
    rpc.shutdown()  # waits for rank 0's shutdown: until then it serves


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    kind = argv[0]
    if kind == "zmq":
        serve_zmq()
    elif kind == "rpc":
        serve_rpc(int(argv[1]))
    else:
        raise SystemExit(f"unknown server {kind!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
