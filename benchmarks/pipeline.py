"""Pipeline-parallel training: measured vs simulated bubbles, 1 vs 2 workers, what goes through the client.

Starts two ``remotorch serve`` workers on loopback (one intra-op thread
each) and trains a stack of residual MLP blocks split into stages:

1. per schedule (GPipe and 1F1B on 2 stages, Interleaved1F1B on 4 stages =
   2 chunks per worker): the median step time (``pipe.step`` + ``opt.step``
   until the workers have done it: the optimizer steps are sent without
   waiting, so the timed step ends with ``session.synchronize()``), the
   bubble measured from when each worker had a request in flight
   (``Pipeline.last_timeline``), and the
   bubble :func:`remotorch.pipeline.simulate.simulate` predicts for the same
   schedule with the per-stage forward/backward times measured in that run;
2. the step time of 1F1B with both stages on one worker vs one per worker
   (informational here: two workers and the client share 2 cores);
3. the client's bytes per steady step vs the activation and gradient bytes the
   workers moved between themselves, at two hidden sizes;
4. a simulated table for 8, 16 and 64 stages x 4..256 microbatches
   (bubble fraction and peak activations on the first worker).

Targets (exit 1 on a miss): the client's bytes per step do not grow with
the hidden size (x16 hidden: at most x1.1 bytes + 512), and the bytes the
workers moved exceed the client's at the large size.

    python benchmarks/pipeline.py [--steps 5] [--width 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import remotorch
from remotorch import pipeline
from remotorch.client.embedded import spawn_worker
from remotorch.pipeline import builders, schedules
from remotorch.pipeline.simulate import simulate


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Stack(torch.nn.Module):
    def __init__(self, width: int, depth: int = 8) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(32, width)
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.out = torch.nn.Linear(width, 8)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


def splits(stages: int, depth: int) -> list[str]:
    return [f"layers.{depth * k // stages}" for k in range(1, stages)]


def train(session, schedule: str, stages: int, *, width: int, batch: int, microbatches: int, steps: int) -> dict:
    """Train a few steps; step times, the last step's timeline, client and worker-to-worker bytes."""
    torch.manual_seed(0)
    model = Stack(width)
    pipe = pipeline.Pipeline(model, splits(stages, 8), session=session, schedule=schedule,
                             microbatches=microbatches, loss_fn=mse)
    opt = pipe.optimizer(torch.optim.SGD, lr=1e-3)
    x, y = torch.randn(batch, 32), torch.randn(batch, 8)
    times, stats = [], []
    for i in range(steps + 2):
        before = session.stats()
        t0 = time.perf_counter()
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        session.synchronize()  # the optimizer steps done on the workers (sent without waiting)
        if i >= 2:  # the first builds the pipeline, the second binds the optimizer
            times.append(time.perf_counter() - t0)
            after = session.stats()
            stats.append({k: after[k] - before[k] for k in ("bytes_sent", "bytes_received", "values_moved")})
    timeline = pipe.last_timeline()
    per_stage = {"F": [[] for _ in range(stages)], "B": [[] for _ in range(stages)]}
    for _, action, t0, t1 in timeline["actions"]:
        a = schedules.Action.parse(action)
        per_stage[a.kind][a.stage].append(t1 - t0)
    fwd = [statistics.median(v) for v in per_stage["F"]]
    bwd = [statistics.median(v) for v in per_stage["B"]]
    predicted = simulate(pipe.schedule, forward=fwd, backward=bwd)
    moved_bytes = _moved_bytes(pipe, microbatches)
    client = statistics.median(s["bytes_sent"] + s["bytes_received"] for s in stats)
    return {"schedule": schedule, "stages": stages, "workers": pipe.schedule.workers,
            "step_ms": 1e3 * statistics.median(times), "bubble_measured": timeline["bubble_fraction"],
            "bubble_simulated": predicted.bubble_fraction, "client_bytes": client,
            "worker_bytes": moved_bytes, "values_moved": stats[-1]["values_moved"]}


def _moved_bytes(pipe, microbatches: int) -> int:
    """Bytes of the activations (and their gradients) that crossed between workers in one step."""
    total = 0
    for e in pipe.layout.edges:
        if not pipe.layout.remote(e):
            continue
        dtype, shape, _ = pipe.layout.runners[e.src].graphs.output_meta[e.output]
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        total += size * microbatches * (2 if pipe.layout.grad_flows(e) else 1)
    return total


def simulated_table() -> list[dict]:
    rows = []
    for stages in (8, 16, 64):
        for mbs in (4, 16, 64, 256):
            row = {"stages": stages, "microbatches": mbs}
            for name, chunks in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)):
                sched = builders.build(name, stages * chunks, mbs, chunks=chunks)
                t = simulate(sched)
                row[name] = (t.bubble_fraction, t.peak_activations[0])
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    workers = [spawn_worker(["--port", "0", "--threads", "1", "--name", f"w{i}"]) for i in range(2)]
    out: dict = {}
    try:
        with remotorch.Session([w.url for w in workers]) as two, remotorch.Session([workers[0].url]) as one:
            common = dict(width=args.width, batch=args.batch, microbatches=args.microbatches, steps=args.steps)
            out["schedules"] = [train(two, "GPipe", 2, **common), train(two, "1F1B", 2, **common),
                                train(two, "Interleaved1F1B", 4, **common)]
            out["one_worker"] = train(one, "1F1B", 2, **common)
            small = train(two, "1F1B", 2, **{**common, "width": 32})
            big = train(two, "1F1B", 2, **{**common, "width": 512})
            out["bytes"] = {"small": small, "big": big}
    finally:
        for w in workers:
            w.stop()
    out["simulated"] = simulated_table()
    ok_flat = out["bytes"]["big"]["client_bytes"] <= 1.1 * out["bytes"]["small"]["client_bytes"] + 512
    ok_moved = out["bytes"]["big"]["worker_bytes"] > out["bytes"]["big"]["client_bytes"]
    out["pass"] = ok_flat and ok_moved
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        _print(out, ok_flat, ok_moved)
    return 0 if out["pass"] else 1


def _print(out: dict, ok_flat: bool, ok_moved: bool) -> None:
    print("schedule          stages workers  step ms  bubble measured  simulated  client B/step  worker B/step")
    for r in [*out["schedules"], out["one_worker"]]:
        print(f"{r['schedule']:<17} {r['stages']:>6} {r['workers']:>7} {r['step_ms']:>8.1f} "
              f"{r['bubble_measured']:>16.3f} {r['bubble_simulated']:>10.3f} {r['client_bytes']:>14,.0f} "
              f"{r['worker_bytes']:>14,}")
    two = out["schedules"][1]["step_ms"]
    print(f"1F1B step, 2 stages: one worker {out['one_worker']['step_ms']:.1f} ms, two workers {two:.1f} ms "
          f"(x{out['one_worker']['step_ms'] / two:.2f}; informational: 2 cores for 2 workers and the client)")
    s, b = out["bytes"]["small"], out["bytes"]["big"]
    print(f"client bytes per steady step: width 32 {s['client_bytes']:,.0f}, width 512 {b['client_bytes']:,.0f} "
          f"-> {'PASS' if ok_flat else 'FAIL'} (no growth with the hidden size)")
    print(f"worker-to-worker bytes per step at width 512: {b['worker_bytes']:,} vs client {b['client_bytes']:,.0f} "
          f"-> {'PASS' if ok_moved else 'FAIL'}")
    print("\nsimulated (forward 1, backward 2): bubble fraction / peak activations on worker 0")
    print("stages  microbatches         GPipe          1F1B   Interleaved(2)")
    for r in out["simulated"]:
        cells = "".join(f"  {r[n][0]:>6.3f} / {r[n][1]:<4}" for n in ("GPipe", "1F1B", "Interleaved1F1B"))
        print(f"{r['stages']:>6} {r['microbatches']:>13}{cells}")


if __name__ == "__main__":
    sys.exit(main())
