"""``remotorch demo``: example models through the embedded worker, checked and timed."""

from __future__ import annotations

import statistics
import time

import torch

from . import models
from ..capture.backend import compile as remote_compile
from ..client.session import Session


def _time_ms(fn, args, repeats: int) -> float:
    fn(*args)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def run_demo(*, engine: str = "eager", device: str = "auto", repeats: int = 50) -> int:
    """Run the examples; returns a process exit code (0 when every result matches)."""
    torch.manual_seed(0)
    cases = [  # .eval() is nn.Module's (inference mode), client side; nothing is evaluated as Python
        ("mlp", models.mlp().eval(), (torch.randn(32, 784),)),
        ("cnn", models.SmallCNN().eval(), (torch.randn(8, 3, 32, 32),)),
        ("transformer block", models.TransformerBlock().eval(), (torch.randn(4, 16, 64),)),
        ("graph break (b>0)", models.bar, (torch.randn(10), torch.rand(10) + 0.1)),
        ("graph break (b<0)", models.bar, (torch.randn(10), -torch.rand(10) - 0.1)),
    ]
    print("starting the embedded worker (a real `remotorch serve` process on this machine)...", flush=True)
    ok = True
    with Session(device=device) as session:
        info = session.health()
        print(f"worker {info['name']!r}: {info['device']}, torch {info['torch_version']}, "
              f"engines {', '.join(info['engines'])}\n")
        print(f"{'model':20s} {'max |diff|':>11s} {'local ms':>9s} {'remote ms':>10s}  engine={engine}")
        compiled_bar = remote_compile(models.bar, session=session, engine=engine, fallback="raise")
        for name, model, args in cases:
            remote = compiled_bar if model is models.bar else remote_compile(
                model, session=session, engine=engine, fallback="raise")
            with torch.no_grad():
                expected = model(*args)
                got = remote(*args)
                diff = _max_diff(expected, got)
                local_ms = _time_ms(model, args, repeats)
                remote_ms = _time_ms(remote, args, repeats)
            ok &= diff <= 1e-4
            print(f"{name:20s} {diff:11.2e} {local_ms:9.3f} {remote_ms:10.3f}")
        stats = session.stats()
    print(f"\nsession: {stats['remote_calls']} remote calls, {stats['graphs_uploaded']} graphs and "
          f"{stats['tensors_uploaded']} weight tensors uploaded once, {stats['fallbacks']} fallbacks, "
          f"{stats['bytes_sent'] / 1e6:.2f} MB sent, {stats['bytes_received'] / 1e6:.2f} MB received")
    print("all outputs match local eager" if ok else "MISMATCH: some outputs differ from local eager")
    return 0 if ok else 1
