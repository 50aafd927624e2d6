"""Fuzz a live worker: malformed requests and broken framing, then check it still computes correctly.

Starts a ``remotorch serve`` worker, sends ``--messages`` seeded malformed
requests (``remotorch.fuzz``) over authenticated connections and
``--framing`` framing breakers over fresh ones, and counts the answers by
kind. Any answer from the worker's catch-all for its own bugs, a reply that
is not a reply, or a dead worker is a failure (exit code 1). At the end a
real session runs a model and compares with local PyTorch.

    python benchmarks/fuzz.py --messages 100000 --seed 1
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import tempfile
import socket
import sys
import time
from collections import Counter

import torch

import remotorch
from remotorch.client.embedded import spawn_worker
from remotorch.devtools import fuzz
from remotorch.codec import messages as m
from remotorch.transport import framing, handshake



def connect(host: str, port: int, token: str) -> framing.FramedChannel:
    sock = socket.create_connection((host, port), timeout=30)
    key = handshake.client_handshake(sock, token.encode(), m.PROTOCOL_VERSION)
    return framing.FramedChannel(sock, key, role="client", max_frame=1 << 30, max_header=1 << 30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--framing", type=int, default=2_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTORCH_")}
    errlog = tempfile.TemporaryFile(mode="w+")
    worker = spawn_worker(["--port", "0", "--token", token, "--threads", "1"], env=env, stderr=errlog)
    url = worker.url
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    tally, bugs = Counter(), []
    try:
        start = time.perf_counter()
        channel = connect(host, int(port), token)
        for i, (header, frames) in enumerate(fuzz.stream(args.seed, args.messages)):
            channel.send(header, frames)
            reply = m.decode(channel.recv()[0])
            if isinstance(reply, m.ErrorReply):
                tally[f"error:{reply.kind}"] += 1
                if reply.kind == "worker" and not reply.message.startswith("graph failed"):
                    bugs.append(reply.message)
            else:
                tally[type(reply).__name__] += 1
            if isinstance(reply, m.AttachReply) or i % 1000 == 999:
                channel.sock.close()
                channel = connect(host, int(port), token)
        channel.sock.close()
        content_s = time.perf_counter() - start
        rng = random.Random(args.seed)
        start = time.perf_counter()
        for _ in range(args.framing):
            channel = connect(host, int(port), token)
            channel.sock.sendall(fuzz.framing_garbage(rng, 0))
            channel.sock.shutdown(socket.SHUT_WR)  # a partial message would hold the loop until its timeout
            try:
                reply = m.decode(channel.recv()[0])
                tally[f"framing:{reply.kind}+closed"] += 1
            except (ConnectionError, OSError, framing.FramingError):
                tally["framing:closed"] += 1
            channel.sock.close()
        framing_s = time.perf_counter() - start
        correct = check(url, token)
    finally:
        alive = worker.alive()
        worker.stop()
        errlog.seek(0)
        stderr = errlog.read()
    print(f"remotorch fuzz: seed {args.seed}")
    print(f"  malformed requests: {args.messages} in {content_s:.1f}s ({args.messages / content_s:.0f}/s)")
    print(f"  framing breakers:   {args.framing} in {framing_s:.1f}s ({args.framing / framing_s:.0f}/s)")
    for k, v in sorted(tally.items()):
        print(f"    {k:28s} {v}")
    print(f"  catch-all answers (worker bugs): {len(bugs)}")
    print(f"  worker alive afterwards: {alive}; correct results afterwards: {correct}")
    for b in bugs[:5]:
        print("  bug:", b)
    ok = alive and correct and not bugs and "unexpected error" not in stderr
    return 0 if ok else 1


def check(url: str, token: str) -> bool:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 2)).eval()
    with remotorch.Session(url, token=token) as s:
        compiled = remotorch.compile(model, session=s, fallback="raise")
        with torch.no_grad():
            return all(torch.equal(compiled(x), model(x)) for x in (torch.randn(4, 10) for _ in range(5)))


if __name__ == "__main__":
    sys.exit(main())
