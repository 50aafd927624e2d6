"""Worker memory of a training step, before and after aot_eager's partitioner and boxed calls (CPU).

A training step's peak memory on the worker is the state it keeps (weights, optimizer state) plus
what the step holds at its worst moment: the activations the forward saved, and what the backward
made before it freed them. Two things cut the second part, as aot_eager does locally:

* the min-cut partitioner (``min_cut_rematerialization_partition``) saves fewer activations and
  recomputes cheap ones in the backward, where ``default_partition`` saved every one it used;
* boxed calls: the worker hands a graph its arguments as one list the graph empties, and a backward
  whose autograd graph is not kept takes its saved activations from the session (``Run.take``), so
  each is freed after its last use instead of when the backward returns.

For every model of the conformance zoo (``remotorch.devtools.zoo``, tiny configs) this runs three
AdamW training steps (``RemoteOptimizer``, ``labels=``) against a worker in this process (the
in-memory transport, so one profiler sees the worker's allocations) twice, in one run:

* ``before``: ``default_partition``, the eager engine called with its arguments spread, no ``take``
  (what remotorch did before);
* ``after``: what it does now.

The figure is the CPU allocator's peak during the last two steps above what was held when they
began (weights, optimizer state and the client's copies, alike in both): torch's profiler records
every allocation and free (``profile_memory=True``). Client-side allocations of a step (inputs,
placeholders) are in it too, a few KB, the same in both. Each measurement runs in a process of its
own (what one model leaves cached in a process, a library's mask cache, moved another's figures by
up to a fifth). It prints one row per model and the totals.

Usage::

    python benchmarks/worker_memory.py [--models GPT2LMHeadModel,LlamaForCausalLM] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

import torch

import remotorch
from remotorch.devtools import zoo
from remotorch.devtools.conformance import synthetic_loss
from remotorch.optim import RemoteOptimizer
from remotorch.transport.loopback import LoopbackTransport
from remotorch.worker.service import Service
from remotorch.worker.worker import Worker


@contextlib.contextmanager
def before_this_change():
    """remotorch as it was: the default partitioner, engines called unboxed, no ``Run.take``."""
    import torch._functorch.partitioners as partitioners

    from remotorch.training import client as training_client
    from remotorch.worker.engines import eager

    def unboxed(graph, device, example_args, artifacts=None):
        return graph.module.to(device).forward

    with contextlib.ExitStack() as stack:
        mp = stack.enter_context(_patch())
        mp(partitioners, "min_cut_rematerialization_partition", partitioners.default_partition)
        mp(eager, "compile", unboxed)
        mp(training_client, "_taken", lambda graph, args: {})
        yield


@contextlib.contextmanager
def _patch():
    undo = []

    def setattr_(obj, name, value):
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        yield setattr_
    finally:
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)


def peak_bytes(fn) -> int:
    """The CPU allocator's highest level while ``fn`` runs, above the level when it began."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    level = peak = 0
    for _, n in events:
        level += n
        peak = max(peak, level)
    return peak


def measure(spec, steps: int = 3) -> int:
    """Peak bytes of the last two of ``steps`` training steps of one zoo model, on a fresh in-process worker."""
    torch._dynamo.reset()
    from remotorch.worker.custom_ops import load_allowed

    service = Service(Worker("cpu", name="memory", allow_ops=load_allowed(spec.allow_ops, ())))
    transport = LoopbackTransport(service.handle, on_disconnect=service.disconnected)
    with remotorch.Session(transport=transport, retry_after=30.0) as s:
        model = spec.build().train()
        compiled = remotorch.compile(model, session=s, fallback="raise")
        opt = RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, session=s)
        inputs = spec.inputs()
        extra = spec.labels(inputs) if spec.labels else {}

        def step():
            out = compiled(**inputs, **extra)
            loss = out.loss if spec.labels else synthetic_loss(out)
            del out
            loss.backward()
            opt.step()
            opt.zero_grad()
            return float(loss.detach())

        step()  # compiles, uploads: the state every later step finds

        def later():
            for _ in range(steps - 1):
                step()
            s.synchronize()

        peak = peak_bytes(later)
    torch._dynamo.reset()
    return peak


def measured_apart(name: str, config: str) -> int:
    """:func:`measure` of one model in one configuration, in a process of its own."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name, "--config", config],
                          capture_output=True, text=True)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode or not last.startswith("{"):
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(last)["peak"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="", help="comma-separated zoo names (default: the whole suite)")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (a measurement in its own process)
    p.add_argument("--config", default="after", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        with before_this_change() if args.config == "before" else contextlib.nullcontext():
            print(json.dumps({"peak": measure(zoo.by_name(args.one))}))
        return 0
    names = [n for n in args.models.split(",") if n] or [s.name for s in zoo.suite()]
    rows, total = {}, {"before": 0, "after": 0}
    print(f"{'model':<40} {'before KiB':>11} {'after KiB':>10} {'after/before':>13}", flush=True)
    for name in names:
        try:
            before, after = measured_apart(name, "before"), measured_apart(name, "after")
        except Exception as exc:  # a model that does not train here: say so, go on
            print(f"{name:<40} failed: {str(exc)[:100]}", flush=True)
            continue
        rows[name] = {"before": before, "after": after}
        total["before"] += before
        total["after"] += after
        print(f"{name:<40} {before / 1024:>11.1f} {after / 1024:>10.1f} {after / max(before, 1):>13.3f}", flush=True)
    ratio = total["after"] / max(total["before"], 1)
    print(f"{'total (' + str(len(rows)) + ' models)':<40} {total['before'] / 1024:>11.1f} "
          f"{total['after'] / 1024:>10.1f} {ratio:>13.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"models": rows, "total": total}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
