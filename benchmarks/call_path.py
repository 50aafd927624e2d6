"""Which of remotorch's files one warm call runs, on the client and on the worker.

A worker serves on loopback from a thread of this process (``WorkerServer``,
the same socket loop, service and worker as ``remotorch serve``), so one
profile hook sees both sides. A compiled MLP is called a few times to warm
up; then the hook records every function of the ``remotorch`` package that
runs during one more call, by thread: the caller's thread is the client, the
server's thread the worker. The output is not read (it stays on the worker,
as in ordinary code that passes it on), and the default session options are
used, as ``torch.compile(model, backend="remotorch")`` would. The call is sent
without waiting, so the trace ends after ``session.synchronize()``, which
waits for its reply (as the next read would): the worker's side of the call
and the client's reading of the reply are in it.

Prints the files of each side, in the order first entered, and the counts.
``--read`` reads the output too (a ``Fetch`` follows); ``--json`` prints
the lists as JSON.

    python benchmarks/call_path.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch

import remotorch
from remotorch import models
from remotorch.worker.server import WorkerServer
from remotorch.worker.worker import Worker

PACKAGE = os.path.dirname(remotorch.__file__) + os.sep


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--read", action="store_true", help="read the output after the call (it is fetched)")
    p.add_argument("--json", action="store_true", help="print the file lists as JSON")
    args = p.parse_args()

    torch.set_num_threads(1)
    token = "call-path-token-0123456789abcdef"
    seen: dict[str, list[str]] = {"client": [], "worker": []}
    me = threading.get_ident()
    tracing = threading.Event()

    def hook(frame, event, arg):
        if event != "call" or not tracing.is_set():
            return
        path = frame.f_code.co_filename
        if not path.startswith(PACKAGE):
            return
        side = "client" if threading.get_ident() == me else "worker"
        rel = path[len(PACKAGE):]
        if rel not in seen[side]:
            seen[side].append(rel)

    server = WorkerServer(Worker("cpu", name="trace"), port=0, token=token)

    def serve() -> None:
        sys.setprofile(hook)  # records only while tracing is set
        server.serve_forever()

    threading.Thread(target=serve, name="worker", daemon=True).start()
    try:
        with remotorch.Session(server.url, token=token) as session, torch.no_grad():
            model = models.mlp().eval()
            compiled = torch.compile(model, backend="remotorch", options={"session": session})
            x = torch.randn(32, 784)
            for _ in range(5):  # warm: captured, uploaded, compiled on the worker
                out = compiled(x)
            torch.testing.assert_close(out, model(x))
            sys.setprofile(hook)
            tracing.set()
            out = compiled(x)
            if args.read:
                out.sum().item()
            session.synchronize()  # the call was sent without waiting: its reply, read
            tracing.clear()
            sys.setprofile(None)
    finally:
        server.shutdown()
    both = sorted(set(seen["client"]) & set(seen["worker"]))
    total = sorted(set(seen["client"]) | set(seen["worker"]))
    if args.json:
        print(json.dumps({**seen, "both": both, "total": len(total)}))
        return 0
    for side in ("client", "worker"):
        print(f"{side}: {len(seen[side])} files")
        for rel in seen[side]:
            print(f"  {rel}")
    print(f"on both sides: {', '.join(both) or 'none'}")
    print(f"distinct files on the path of one warm call: {len(total)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
