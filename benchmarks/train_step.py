"""What does one training step cost when forward, backward and AdamW run on a remotorch worker?

Everything below is measured in one run, against a real ``remotorch serve``
worker subprocess on loopback (spawned here unless ``--url`` is given), and
every ratio comes from figures of that same run. For each model (the core
MLP, 32×784 inputs with cross-entropy; the transformer block, 8×16×64 inputs
with MSE):

1. **Wire bytes per steady-state step**: what ``session.stats()`` counts sent
   plus received over warm steps (forward, backward, ``opt.step()``,
   ``opt.zero_grad()``), against inputs + labels + loss bytes.
   Target: <= inputs + labels + loss + 2 KiB (no weights, no activations).
2. **Step time**: the remote step (``remotorch.compile(..., fallback="raise")``
   and ``RemoteOptimizer(torch.optim.AdamW)``, until the worker has done it:
   each request is sent without waiting, so the timed step ends with
   ``session.synchronize()``) vs the same step purely local
   (eager model, ``torch.optim.AdamW``) on this machine's CPU. Remote and
   local steps run one by one in interleaved rounds on the same batches, so
   machine noise hits both alike, and the two trainings must agree at the end:
   target max abs parameter difference <= 1e-4 (the same CPU kernels on both
   sides agree to float rounding; a wrong gradient or optimizer step moves
   parameters by about the learning rate, 1e-3, per step).
3. **Worker memory**: ``resident_bytes`` from the worker's health reply after
   10 and after ``--steps`` (default 1,000) steps, pending releases flushed
   first, less what the worker held before this model's session started
   (each model trains in its own session).
   Expected: flat, parameters + AdamW state (3× the parameters, plus a step
   counter per tensor).

When the worker is spawned here, this process and the worker each get half
the CPUs' intra-op threads, as in ``benchmarks/overhead.py``.

Usage::

    python benchmarks/train_step.py [--device cpu|cuda] [--url tcp://h:p --token T]
                                    [--steps 1000] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import secrets
import statistics
import sys
import time

import torch
from torch.nn import functional as F

import remotorch
from remotorch.client.embedded import spawn_worker
from remotorch import models
from remotorch.optim import RemoteOptimizer

WIRE_SLACK = 2048
PARAM_TOL = 1e-4


class Case:
    """One model, its loss, a batch maker, and a remote and a local training loop over it."""

    def __init__(self, name: str, model: torch.nn.Module, loss, batch, session) -> None:
        self.name = name
        self.batch = batch
        self.model = model
        self.reference = copy.deepcopy(model)
        self.remote_step_fn = remotorch.compile(lambda x, y: loss(model(x), y), session=session,
                                                fallback="raise")
        self.local_step_fn = lambda x, y: loss(self.reference(x), y)
        self.opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), session=session, lr=1e-3)
        self.ref_opt = torch.optim.AdamW(self.reference.parameters(), lr=1e-3)

    def remote(self, x, y) -> torch.Tensor:
        loss = self.remote_step_fn(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss

    def local(self, x, y) -> torch.Tensor:
        loss = self.local_step_fn(x, y)
        loss.backward()
        self.ref_opt.step()
        self.ref_opt.zero_grad()
        return loss


def measure(case: Case, session: remotorch.Session, steps: int, baseline: int) -> dict:
    batches = [case.batch() for _ in range(8)]
    x, y = batches[0]
    done = 0
    while done < 10:  # compile both graphs, bind the parameters, create the optimizer state
        case.remote(*batches[done % len(batches)])
        case.local(*batches[done % len(batches)])
        done += 1
    session.flush_releases()
    mem_early, early_at = session.health()["resident_bytes"] - baseline, done
    # wire bytes over warm steps
    before = session.stats()
    n_wire = 20
    for i in range(n_wire):
        loss = case.remote(*batches[i % len(batches)])
        case.local(*batches[i % len(batches)])
    session.synchronize()  # every reply read: counted
    after = session.stats()
    done += n_wire
    sent = (after["bytes_sent"] - before["bytes_sent"]) / n_wire
    received = (after["bytes_received"] - before["bytes_received"]) / n_wire
    payload = x.nbytes + y.nbytes + loss.nbytes
    # interleaved timing for the remaining steps
    remote_ns, local_ns = [], []
    i = 0
    while done < steps:
        xb, yb = batches[i % len(batches)]
        t0 = time.perf_counter_ns()
        case.remote(xb, yb)
        session.synchronize()  # the step done on the worker (its requests were sent without waiting)
        t1 = time.perf_counter_ns()
        case.local(xb, yb)
        t2 = time.perf_counter_ns()
        remote_ns.append(t1 - t0)
        local_ns.append(t2 - t1)
        done += 1
        i += 1
    session.flush_releases()
    mem_late = session.health()["resident_bytes"] - baseline
    session.pull(case.model)
    diff = max((p - q).abs().max().item() for p, q in zip(case.model.parameters(), case.reference.parameters()))
    params = sum(p.numel() * p.element_size() for p in case.model.parameters())
    return {"sent_per_step": sent, "received_per_step": received, "payload": payload,
            "wire_target": payload + WIRE_SLACK, "remote_median_ms": statistics.median(remote_ns) / 1e6,
            "local_median_ms": statistics.median(local_ns) / 1e6, "timed_steps": len(remote_ns),
            "mem_early_step": early_at, "mem_early": mem_early, "mem_late_step": done, "mem_late": mem_late,
            "param_bytes": params, "max_param_diff": diff}


def report(name: str, r: dict) -> bool:
    wire = r["sent_per_step"] + r["received_per_step"]
    wire_ok = wire <= r["wire_target"]
    flat = r["mem_early"] == r["mem_late"]
    print(f"\n{name}: {r['param_bytes']:,} bytes of parameters")
    print(f"  wire bytes per steady-state step: sent {r['sent_per_step']:.0f} + received "
          f"{r['received_per_step']:.0f} = {wire:.0f}; inputs + labels + loss = {r['payload']:,}; "
          f"overhead {wire - r['payload']:.0f} B (target <= {WIRE_SLACK})  {'PASS' if wire_ok else 'FAIL'}")
    print(f"  step time, median of {r['timed_steps']} interleaved steps: remote {r['remote_median_ms']:.3f} ms, "
          f"local {r['local_median_ms']:.3f} ms, remote/local = "
          f"{r['remote_median_ms'] / r['local_median_ms']:.2f}x")
    print(f"  worker resident bytes: after {r['mem_early_step']} steps {r['mem_early']:,}, after "
          f"{r['mem_late_step']} steps {r['mem_late']:,} ({r['mem_late'] / r['param_bytes']:.2f}x the "
          f"parameters)  {'FLAT' if flat else 'GREW'}")
    agree = r["max_param_diff"] <= PARAM_TOL
    print(f"  remote vs local training after {r['mem_late_step']} AdamW steps: max |Δparam| = "
          f"{r['max_param_diff']:.2e} (target <= {PARAM_TOL:g})  {'PASS' if agree else 'FAIL'}")
    return wire_ok and flat and agree


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="device of the spawned worker")
    p.add_argument("--url", help="use this running worker instead of spawning one")
    p.add_argument("--token", help="the worker's token (with --url; default $REMOTORCH_TOKEN)")
    p.add_argument("--steps", type=int, default=1000, help="steps per model (memory is read after these)")
    p.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    if args.steps < 40:
        p.error("--steps must be at least 40")
    threads = max(1, (os.cpu_count() or 2) // 2)
    url, token, proc = args.url, args.token or os.environ.get("REMOTORCH_TOKEN"), None
    if url is None:
        torch.set_num_threads(threads)
        token = secrets.token_hex(16)
        worker = spawn_worker(["--host", "127.0.0.1", "--port", "0", "--token", token, "--device", args.device,
                               "--name", "train-bench", "--threads", str(threads)])
        url = worker.url
    start = time.perf_counter()
    results, ok = {}, True
    try:
        with remotorch.Session(url, token=token) as observer:
            info = observer.health()
            print(f"remotorch training-step benchmark: torch {torch.__version__}, python "
                  f"{platform.python_version()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} "
                  f"intra-op threads here; worker {url} on {info['device']}, engine eager")
            specs = [
                ("MLP 784-256-10, batch 32, cross-entropy", models.mlp, F.cross_entropy,
                 lambda: (torch.randn(32, 784), torch.randint(0, 10, (32,)))),
                ("Transformer block dim 64, 4 heads, batch 8x16, MSE", models.TransformerBlock,
                 F.mse_loss, lambda: (torch.randn(8, 16, 64), torch.randn(8, 16, 64))),
            ]
            for name, make, loss, batch in specs:
                # each model in its own session, so the worker's memory figures are its alone
                baseline = observer.health()["resident_bytes"]
                torch.manual_seed(0)
                with remotorch.Session(url, token=token) as session:
                    results[name] = measure(Case(name, make(), loss, batch, session), session,
                                            args.steps, baseline)
                ok &= report(name, results[name])
                deadline = time.monotonic() + 10
                while observer.health()["resident_bytes"] != baseline and time.monotonic() < deadline:
                    time.sleep(0.05)
    finally:
        if proc is not None:
            worker.stop()
    results["wall_s"] = time.perf_counter() - start
    print(f"\ntotal wall time {results['wall_s']:.1f} s")
    print("all targets met" if ok else "FAIL: a target was missed (see above)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
