"""Worker-to-worker deliveries on one kept connection per peer vs a new connection each, in one run.

A real ``remotorch serve`` on loopback receives; this process sends as a
worker does, with the worker's own :class:`~remotorch.worker.peers.PeerLinks`:
"kept" is the default (one idle connection per peer, each later delivery
under its own ticket with a proof), "new" a ``PeerLinks`` that never reuses a
connection (a handshake per delivery, as deliveries worked before). A client
session asks the receiver for each ticket, outside the timed part. Blocks of
each alternate so both see the same load; the numbers are medians per
delivery.

Target (exit 1 on a miss): at 4 KiB, a kept-connection delivery takes at
most 0.8x a new-connection one.

    python benchmarks/peer_links.py [--deliveries 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time

import torch

import remotorch
from remotorch.client.embedded import spawn_worker
from remotorch.codec import messages as m
from remotorch.worker.peers import PeerLinks


def deliver_block(links: PeerLinks, conn, url: str, value: torch.Tensor, n: int, first_handle: int) -> list[float]:
    meta = m.TensorMeta("float32", list(value.shape), list(value.stride()), 0)
    tickets = [conn.request(m.ExpectHandles([first_handle + i], [meta]))[0] for i in range(n)]
    times = []
    for t in tickets:
        t0 = time.perf_counter()
        links.send(url, t.ticket_id, t.secret, [value], timeout=30.0)
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deliveries", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    token = secrets.token_hex(16)
    worker = spawn_worker(["--port", "0", "--name", "receiver", "--threads", "1"],
                          env={**os.environ, "REMOTORCH_TOKEN": token})
    results = {}
    handle = 1
    try:
        with remotorch.Session(worker.url, token=token) as s:
            conn = s.connections()[0]
            for label, numel in (("4 KiB", 1024), ("1 MiB", 256 * 1024)):
                value = torch.randn(numel)
                kept, new = PeerLinks(), PeerLinks(idle_s=-1.0)
                times = {"kept": [], "new": []}
                block = 20
                for _ in range(max(1, args.deliveries // block)):
                    for name, links in (("kept", kept), ("new", new)):
                        times[name] += deliver_block(links, conn, worker.url, value, block, handle)
                        conn.request(m.Flush(), pending=m.Pending(handles=list(range(handle, handle + block))),
                                     expect=m.Ok)  # dropped again: the receiver holds one block at most
                        handle += block
                med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
                results[label] = dict(kept_us=med["kept"], new_us=med["new"], ratio=med["kept"] / med["new"],
                                      handshakes_kept=kept.opened, handshakes_new=new.opened)
                kept.close()
                new.close()
    finally:
        worker.stop()

    print("worker-to-worker delivery: kept connection per peer vs a new connection each (median per delivery)")
    for label, r in results.items():
        print(f"  {label:6s}: kept {r['kept_us']:8.1f} us ({r['handshakes_kept']} handshake) | "
              f"new {r['new_us']:8.1f} us ({r['handshakes_new']} handshakes) | ratio {r['ratio']:.2f}x")
    missed = [] if results["4 KiB"]["ratio"] <= 0.8 else [f"4 KiB ratio {results['4 KiB']['ratio']:.2f} > 0.8"]
    print("target:", "met" if not missed else "MISSED: " + "; ".join(missed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results=results, missed=missed), f, indent=2)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
