"""What one eager torch call on a value kept on a worker costs the client, against torch's own dispatch.

A loop of small elementwise calls (``y = y * 1.0001``, ``y = y + 0.5``…) on a
value kept on a real ``remotorch serve`` worker on loopback: each call is sent
to the worker without waiting (``remotorch.client.eager``), and the loop ends
with one read. Printed, for the same loop in the same process:

* torch's own CPU dispatch of the calls on a local tensor of the same size
  (µs per call, this process's CPU time);
* remotorch's client CPU time per call (the worker runs in its own process,
  so its time is not counted), and the wall time per call; and the same for
  the long way every call took before its run was prepared
  (``remotorch.client.prepared``), measured in the same run;
* bytes sent and received per call (a call's request and its reply), and the
  round trips waited for (one: the read).

    python benchmarks/eager_ops.py [--ops 2000] [--numel 64] [--transport tcp|unix]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import secrets
import time

import torch

import remotorch
from remotorch.client import eager
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


@contextlib.contextmanager
def long_way(conn, on: bool):
    """With ``on``, every eager call goes the long way (the generic graph call, as before its run was
    prepared: ``remotorch.client.prepared``) on ``conn``, to compare the two in the same run."""
    if not on:
        yield
        return
    saved = eager.prepare
    eager.prepare = lambda *a: False
    for entry in conn.__dict__.get("eager_graphs", {}).values():
        if isinstance(entry, eager.OpGraph):
            entry.prepared = None
    try:
        yield
    finally:
        eager.prepare = saved


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
            y = keep(x)
            chain(y, 8).sum().item()  # every call's graph made and uploaded once, and its run prepared
            rows: dict[str, tuple] = {}
            for _ in range(args.repeats):  # (interleaved: the three share what the machine does meanwhile)
                local = cpu_s(lambda: chain(x, n))[0] / n
                if "torch" not in rows or local < rows["torch"][0]:
                    rows["torch"] = (local,)
                for way in ("prepared", "long"):
                    with long_way(session.connection, way == "long"):
                        before = session.stats()
                        c, w = cpu_s(lambda: chain(y, n).sum().item())
                        after = session.stats()
                    d = {k: after[k] - before[k] for k in ("bytes_sent", "bytes_received", "blocking_reads",
                                                           "eager_ops")}
                    if way not in rows or c / d["eager_ops"] < rows[way][0]:
                        rows[way] = (c / d["eager_ops"], w / d["eager_ops"], d)
            local = rows["torch"][0]
            print(f"eager calls on a value kept on the worker ({args.transport}, {args.numel} elements, "
                  f"{rows['prepared'][2]['eager_ops']} calls, least of {args.repeats})")
            print(f"  torch's own CPU dispatch:      {local * 1e6:8.1f} µs a call")
            for way, what in (("prepared", "remotorch client CPU"), ("long", "  the long way, for comparison")):
                c, w, d = rows[way]
                print(f"  {what + ':':30s} {c * 1e6:8.1f} µs a call ({c / local:.1f}x torch's dispatch), "
                      f"wall {w * 1e6:.1f} µs")
            d, ops = rows["prepared"][2], rows["prepared"][2]["eager_ops"]
            print(f"  bytes a call: sent {d['bytes_sent'] / ops:.0f}, received {d['bytes_received'] / ops:.0f}; "
                  f"round trips waited: {d['blocking_reads']}")
            got = chain(keep(x), n)
            assert torch.equal(got, chain(x, n)), "the remote result differs from torch's"
    finally:
        worker.stop()


if __name__ == "__main__":
    main()
