"""What one eager torch call on a value kept on a worker costs the client, against torch's own dispatch.

A loop of small elementwise calls (``y = y * 1.0001``, ``y = y + 0.5``…) on a
value kept on a real ``remotorch serve`` worker on loopback: each call is sent
to the worker without waiting (``remotorch.client.eager``), and the loop ends
with one read. Printed, for the same loop in the same process:

* torch's own CPU dispatch of the calls on a local tensor of the same size
  (µs per call, this process's CPU time);
* remotorch's client CPU time per call (the worker runs in its own process,
  so its time is not counted), and the wall time per call;
* bytes sent and received per call (a call's request and its reply), and the
  round trips waited for (one: the read).

    python benchmarks/eager_ops.py [--ops 2000] [--numel 64] [--transport tcp|unix]
"""

from __future__ import annotations

import argparse
import gc
import secrets
import time

import torch

import remotorch
from remotorch.client.embedded import spawn_worker


def chain(y: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` small elementwise calls on ``y``."""
    for i in range(n // 4):
        y = y * 1.0001
        y = y + 0.5
        y = torch.relu(y)
        y = y - 0.25
    return y


def cpu_s(fn) -> tuple[float, float]:
    """(this process's CPU seconds, wall seconds) of ``fn()``, the collector off."""
    gc.collect()
    gc.disable()
    try:
        c, w = time.process_time(), time.perf_counter()
        fn()
        return time.process_time() - c, time.perf_counter() - w
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="calls in the measured loop (a multiple of 4)")
    parser.add_argument("--numel", type=int, default=1024, help="elements of the value")
    parser.add_argument("--repeats", type=int, default=3, help="loops measured; the least is printed")
    parser.add_argument("--transport", choices=("tcp", "unix"), default="tcp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    token = secrets.token_hex(16)
    where = ["--host", "127.0.0.1", "--port", "0"] if args.transport == "tcp" else []
    worker = spawn_worker([*where, "--token", token, "--name", "eager-bench", "--threads", "1"])
    n = args.ops // 4 * 4
    x = torch.randn(args.numel)
    try:
        with remotorch.Session(worker.url, token=token) as session, torch.no_grad():
            keep = remotorch.compile(lambda a: a + 0, session=session, fallback="raise")
            local = min(cpu_s(lambda: chain(x, n))[0] for _ in range(args.repeats)) / n

            def remote() -> None:
                chain(y, n).sum().item()

            y = keep(x)
            chain(y, 8).sum().item()  # every call's graph made and uploaded once
            best = None
            for _ in range(args.repeats):
                before = session.stats()
                c, w = cpu_s(remote)
                after = session.stats()
                d = {k: after[k] - before[k] for k in ("bytes_sent", "bytes_received", "blocking_reads",
                                                       "eager_ops")}
                if best is None or c < best[0]:
                    best = (c, w, d)
            c, w, d = best
            ops = d["eager_ops"]
            print(f"eager calls on a value kept on the worker ({args.transport}, {args.numel} elements, "
                  f"{ops} calls, least of {args.repeats})")
            print(f"  torch's own CPU dispatch:      {local * 1e6:8.1f} µs a call")
            print(f"  remotorch client CPU:          {c / ops * 1e6:8.1f} µs a call "
                  f"({c / ops / local:.1f}x torch's dispatch)")
            print(f"  remotorch wall:                {w / ops * 1e6:8.1f} µs a call")
            print(f"  bytes a call: sent {d['bytes_sent'] / ops:.0f}, received {d['bytes_received'] / ops:.0f}; "
                  f"round trips waited: {d['blocking_reads']}")
            got = chain(keep(x), n)
            assert torch.equal(got, chain(x, n)), "the remote result differs from torch's"
    finally:
        worker.stop()


if __name__ == "__main__":
    main()
