"""Data parallelism on real workers: step time 1 vs 2 replicas, the all-reduce vs raw torch.distributed, bytes.

Starts real ``remotorch serve`` workers on loopback (one intra-op thread
each) and trains an MLP (``--width``, ``--layers``) with AdamW, in one run:

1. the same global batch on 1 replica (one worker) and on 2 replicas (two
   workers): median step time (``dp.step`` + ``opt.step``, until the workers
   have done it: the optimizer step is sent without waiting, so the timed
   step ends with ``session.synchronize()``), the losses
   checked equal to one local process training on the whole batch (1e-4),
   the 2-replica parameters checked equal to the reference after the run;
2. the all-reduce of a step (``pipe.last_timing["reduce_s"]``: from the
   later replica's end of backward, as the client saw it, to every gradient
   averaged; each replica's worker starts averaging as its backward ends)
   against the same for plain ``torch.distributed`` data parallelism: two
   processes on loopback with gloo training the same MLP on the same halves
   of the batch, averaging right after each backward with the worker's own
   bucketing (the floor: the collective in a real step, no request, no
   slot bookkeeping); and, for scale, against raw ``all_reduce`` of the
   same buckets after a barrier, with no training around it;
3. the same 2 replicas with the all-reduce overlapped with backward
   (``overlap_before``: each replica's model in two parts on its worker, the
   later part's gradients averaged while the earlier part's backward runs)
   against averaging after the whole backward;
4. bytes per steady step: what the client sent and received, and what the
   workers moved between themselves (nominal ring all-reduce volume,
   2 x (R-1)/R x gradient bytes per worker).

Exit 1 on a wrong result (losses or parameters not equal to the reference),
or when the all-reduce per step takes more than 1.2x plain torch.distributed's.

    python benchmarks/data_parallel.py [--width 1024] [--layers 4] [--steps 24] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

import remotorch
from remotorch.client.embedded import spawn_worker


def mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(64, width), nn.Tanh()]
    for _ in range(layers - 2):
        mods += [nn.Linear(width, width), nn.Tanh()]
    mods.append(nn.Linear(width, 16))
    return nn.Sequential(*mods)


def raw_rank(args) -> None:
    """One process of the raw all_reduce floor (run as a subprocess of this script)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, world_size=2, is_master=args.raw_rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=60)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), args.raw_rank, 2, opts)
    if args.raw_step:
        return raw_step_rank(args, pg)
    sizes = [int(s) for s in args.buckets.split(",")]
    flats = [torch.randn(n // 4) for n in sizes]
    times = []
    for _ in range(args.iters):
        pg.barrier().wait()
        t0 = time.perf_counter()
        works = [pg.allreduce([f]) for f in flats]
        for w in works:
            w.wait()
        times.append(time.perf_counter() - t0)
    if args.raw_rank == 0:
        print(json.dumps(times))


def raw_step_rank(args, pg) -> None:
    """Plain torch.distributed data parallelism, the in-step floor: each process trains the same MLP
    on its half of the batch, and right after its backward averages the gradients (gradients of
    1 MiB or more in place, the others through one flat buffer: the worker's own bucketing). The
    time counted is the one remotorch's ``reduce_s`` counts: from the later process's end of
    backward to its gradients averaged (both processes share this host's monotonic clock)."""
    model = mlp(args.width, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, 64, generator=g), torch.randn(args.batch, 16, generator=g)
    half = args.batch // 2
    x, y = x[args.raw_rank * half:(args.raw_rank + 1) * half], y[args.raw_rank * half:(args.raw_rank + 1) * half]
    times = []
    for _ in range(args.iters):
        (F.mse_loss(model(x), y) / 2).backward()
        ended = time.perf_counter()
        grads = [p.grad for p in model.parameters()]
        big = [t for t in grads if t.numel() * t.element_size() >= 1 << 20]
        small = [t for t in grads if t.numel() * t.element_size() < 1 << 20]
        flat = torch.cat([t.reshape(-1) for t in small])
        works = [pg.allreduce([t]) for t in big] + [pg.allreduce([flat])]
        for w in works:
            w.wait()
        offset = 0
        for t in small:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        done = time.perf_counter()
        stamps = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]
        pg.allgather([stamps], [torch.tensor([ended, done], dtype=torch.float64)]).wait()
        times.append(max(float(t[1]) for t in stamps) - max(float(t[0]) for t in stamps))
        opt.step()
        opt.zero_grad()
    if args.raw_rank == 0:
        print(json.dumps(times))


def raw_allreduce(bucket_bytes: list[int], iters: int, step: dict | None = None) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--port", str(port), "--buckets", ",".join(map(str, bucket_bytes)),
           "--iters", str(iters)]
    if step:
        cmd += ["--raw-step", "--width", str(step["width"]), "--layers", str(step["layers"]),
                "--batch", str(step["batch"])]
    cmd += ["--raw-rank"]
    procs = [subprocess.Popen(cmd + [str(r)], stdout=subprocess.PIPE, text=True) for r in range(2)]
    out = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("the raw all_reduce processes failed")
    return json.loads(out[0])


def buckets_of(model: nn.Module, limit: int) -> list[int]:
    sizes, size = [], 0
    for p in model.parameters():
        n = p.numel() * p.element_size()
        if size and size + n > limit:
            sizes.append(size)
            size = 0
        size += n
    return sizes + [size]


def back_to_back(dp, rounds: int = 20) -> list[float]:
    """The all-reduce alone: the same ReduceGrads on every member, ``rounds`` times in a row, no step
    between (what raw all_reduce measures); the gradients are summed again each time (not used after)."""
    col = dp.pipe.columns[0]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        col.reduce(1.0, dp.pipe.bucket_bytes)
        times.append(time.perf_counter() - t0)
    return times


def train(session, model, x, y, steps: int, workers: list[int], overlap_before=()):
    dp = remotorch.parallel.DataParallel(model, session=session, loss_fn=F.mse_loss, workers=workers,
                                         overlap_before=overlap_before)
    opt = dp.optimizer(torch.optim.AdamW, lr=1e-3)
    losses, step_s, reduce_s, sent, received = [], [], [], [], []
    for i in range(steps):
        before = session.stats()
        t0 = time.perf_counter()
        loss = dp.step(x, y)
        opt.step()
        opt.zero_grad()
        session.synchronize()  # the optimizer steps done on the workers (sent without waiting)
        step_s.append(time.perf_counter() - t0)
        after = session.stats()
        losses.append(float(loss))
        reduce_s.append(dp.pipe.last_timing.get("reduce_s", 0.0))
        sent.append(after["bytes_sent"] - before["bytes_sent"])
        received.append(after["bytes_received"] - before["bytes_received"])
    dp.pull()
    alone = back_to_back(dp) if len(workers) > 1 and not overlap_before else []
    warm = slice(2, None)  # the first steps trace, upload and make the optimizers
    return dict(losses=losses, alone_s=alone, step_s=statistics.median(step_s[warm]), reduce_s=reduce_s[warm],
                sent=statistics.median(sent[warm]), received=statistics.median(received[warm]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", default=None)
    ap.add_argument("--raw-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--buckets", default="", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--raw-step", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.raw_rank is not None:
        raw_rank(args)
        return 0
    torch.set_num_threads(1)
    token = secrets.token_hex(16)
    env = {**os.environ, "REMOTORCH_TOKEN": token}
    workers = [spawn_worker(["--port", "0", "--name", f"dp{i}", "--threads", "1"], env=env) for i in range(2)]
    model = mlp(args.width, args.layers)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, 64, generator=g), torch.randn(args.batch, 16, generator=g)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    expected = []
    for _ in range(args.steps):
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        expected.append(loss.item())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        with remotorch.Session([w.url for w in workers], token=token) as s:
            one = train(s, copy.deepcopy(model), x, y, args.steps, [0])
        with remotorch.Session([w.url for w in workers], token=token) as s:
            two_model = copy.deepcopy(model)
            two = train(s, two_model, x, y, args.steps, [0, 1])
        middle = [str(2 * (args.layers // 2))]  # the model in two parts: the later part's average overlaps
        with remotorch.Session([w.url for w in workers], token=token) as s:
            lap_model = copy.deepcopy(model)
            lap = train(s, lap_model, x, y, args.steps, [0, 1], overlap_before=middle)
    finally:
        for w in workers:
            w.stop()
    raw = raw_allreduce(buckets_of(model, 25 << 20), 33)[3:]
    raw_step = raw_allreduce([], args.steps + 1, dict(width=args.width, layers=args.layers, batch=args.batch))[3:]

    wrong = []
    for name, r in (("1 replica", one), ("2 replicas", two), ("2 replicas, overlapped", lap)):
        if not torch.allclose(torch.tensor(r["losses"]), torch.tensor(expected), rtol=1e-4, atol=1e-4):
            wrong.append(f"{name}: losses {r['losses']} != reference {expected}")
    for label, trained in (("2 replicas", two_model), ("2 replicas, overlapped", lap_model)):
        for (n, p), q in zip(trained.named_parameters(), ref.parameters()):
            if not torch.allclose(p, q, rtol=1e-4, atol=2e-3):
                wrong.append(f"{label}: parameter {n} differs from the reference")
    reduce_med, raw_med = statistics.median(two["reduce_s"]), statistics.median(raw)
    raw_step_med = statistics.median(raw_step)
    ratio = reduce_med / raw_step_med
    params = sum(p.numel() for p in model.parameters())
    print(f"data parallelism: MLP {args.layers} x {args.width} ({params / 1e6:.1f} M parameters, "
          f"{grad_bytes / 2**20:.1f} MiB of gradients), batch {args.batch}, AdamW, 1 thread per worker")
    print(f"  step (dp.step + opt.step), median: 1 replica {one['step_s'] * 1e3:8.1f} ms | "
          f"2 replicas {two['step_s'] * 1e3:8.1f} ms (x{one['step_s'] / two['step_s']:.2f})")
    print(f"  2 replicas, averaging overlapped with backward (model in 2 parts per worker): "
          f"{lap['step_s'] * 1e3:8.1f} ms (x{two['step_s'] / lap['step_s']:.2f} of after-backward); "
          f"waiting for it after the last backward {statistics.median(lap['reduce_s']) * 1e3:.1f} ms")
    print(f"  all-reduce per step, from the later backward's end: remotorch {reduce_med * 1e3:7.1f} ms | raw "
          f"torch.distributed data parallelism (gloo, 2 processes training the same MLP) "
          f"{raw_step_med * 1e3:7.1f} ms | ratio {ratio:.2f}x")
    print(f"  raw all_reduce of the same buckets after a barrier, no training: {raw_med * 1e3:7.1f} ms "
          f"(remotorch per step / this: {reduce_med / raw_med:.2f}x)")
    alone_med = statistics.median(two["alone_s"])
    print(f"  all-reduce alone, back to back (no step between, as raw is measured): remotorch "
          f"{alone_med * 1e3:7.1f} ms | ratio {alone_med / raw_med:.2f}x")
    print(f"  client bytes per steady step: 1 replica sent {one['sent']:,.0f} received {one['received']:,.0f} | "
          f"2 replicas sent {two['sent']:,.0f} received {two['received']:,.0f}")
    print(f"  worker-to-worker bytes per step (ring all-reduce, per worker): {grad_bytes:,} "
          f"(2 x (2-1)/2 x {grad_bytes:,} gradient bytes)")
    print("  losses equal the one-process reference (1e-4):", "yes" if not wrong else "NO")
    missed = list(wrong)
    if ratio > 1.2:
        missed.append(f"all-reduce {ratio:.2f}x raw torch.distributed > 1.2x")
    print("result:", "ok" if not missed else "MISSED: " + "; ".join(missed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(one=one, two=two, overlapped=lap, raw_s=raw, raw_step_s=raw_step, ratio=ratio, expected=expected, missed=missed), f, indent=2)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
