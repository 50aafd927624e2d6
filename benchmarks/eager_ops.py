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
  round trips waited for (one: the read);
* what one such call costs the worker: the same calls as the client sends
  them (``Run`` messages of 16, each after the housekeeping that rides on
  it), handled by a worker's service in this process, without sockets: its
  CPU time per call, the engine call within it, and torch's own op on a
  local tensor.

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
    """(this process's CPU seconds, wall seconds) of ``fn()``, Python's collector on, as in a user's loop
    (garbage that only the collector frees costs its full collections of the whole heap)."""
    gc.collect()
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c, time.perf_counter() - w


def worker_cost(numel: int, repeats: int, batches: int = 100, batch: int = 16) -> tuple[float, float, float]:
    """(worker CPU seconds per eager call, the engine call's seconds within it, torch's op's seconds):
    ``x * 1.0001`` on a kept value of ``numel`` elements, ``batch`` calls a ``Runs`` message as the client
    queues them (each value released by the call after the next, as a chain's are), handled by a
    :class:`~remotorch.worker.service.Service` in this process; the least of ``repeats`` series."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from remotorch.codec import messages as m
    from remotorch.codec.frames import FrameWriter
    from remotorch.codec.graph import encode_graph
    from remotorch.worker.service import Service
    from remotorch.worker.worker import Worker

    service, x = Service(Worker("cpu", name="eager-bench")), torch.randn(numel)
    state = {"seq": 1, "h": 1}

    def ask(body, frames=()):
        header, _ = service.handle(1, m.encode(body, None, seq=state["seq"]), list(frames))
        state["seq"] += 1
        return m.decode(header)

    payload = encode_graph(make_fx(lambda v: v * 1.0001)(x))
    assert type(ask(m.PutGraph(payload.graph_id, payload.doc, payload.consts), payload.const_frames)) is m.Ok
    w = FrameWriter()
    assert type(ask(m.Run(payload.graph_id, args=[w.value(x)], keep=[0], handle_base=1, brief=True),
                    w.frames)) is m.RunReply
    gid, engine_ms = payload.graph_id[:m.SHORT_GRAPH_ID], []

    def one_batch() -> None:
        h, runs, chores = state["h"], [], []
        for j in range(batch):
            runs.append(m.Run(gid, args=[m.HandleArg(h + j)], keep=[0], handle_base=h + j + 1, brief=True))
            chores.append(m.Pending(handles=[h + j - 1]) if h + j > 1 else None)
        reply = ask(m.Runs(runs, [0] * batch, chores))
        assert type(reply) is m.RunsReply and not reply.said, reply
        engine_ms.extend(reply.run_ms)
        state["h"] = h + batch

    best = [float("inf")] * 2
    for _ in range(repeats):
        engine_ms.clear()
        run = cpu_s(lambda: [one_batch() for _ in range(batches)])[0] / (batches * batch)
        op = cpu_s(lambda: _calls(x, batches * batch))[0] / (batches * batch)
        best = [min(best[0], run), min(best[1], op)]
    return best[0], sorted(engine_ms)[len(engine_ms) // 2] / 1e3, best[1]


def _calls(x: torch.Tensor, n: int) -> None:
    for _ in range(n):  # (each result dropped at once, as a chain's are)
        x * 1.0001


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
    run, engine, op = worker_cost(args.numel, args.repeats)
    print(f"the worker, per eager call (Run messages of 16, in this process; CPU, least of {args.repeats}):")
    print(f"  handling the call:  {run * 1e6:8.1f} µs, of which the engine's call {engine * 1e6:.1f} µs")
    print(f"  torch's own op:     {op * 1e6:8.1f} µs (the same call on a local tensor)")


if __name__ == "__main__":
    main()
