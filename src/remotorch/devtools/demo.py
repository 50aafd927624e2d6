"""``remotorch demo``: example models through the embedded worker, checked and timed.

Client and embedded worker share this machine's cores, so the comparison is
made the way ``benchmarks/overhead.py`` makes it: each side gets half the
cores for its kernels (the embedded worker takes half; the client sets the
other half here), local and remote calls alternate within every round (so a
noisy moment hits both), and the table shows medians.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from ..capture.backend import compile as remote_compile
from ..client.progress import bar
from ..client.session import Session
from ..profile.tables import is_terminal, table, write
from . import models


def _timed(fn, args) -> float:
    """Milliseconds of ``fn(*args)`` until its result is here (a remote call's is read: it was sent
    without waiting, and the time that matters is until the value can be used)."""
    start = time.perf_counter()
    out = fn(*args)
    materialize = getattr(out, "materialize_", None)
    if materialize is not None:
        materialize()
    return (time.perf_counter() - start) * 1e3


def interleaved_ms(local, remote, args, rounds: int) -> tuple[float, float]:
    """Median milliseconds of ``local(*args)`` and ``remote(*args)``, timed in alternating order per round."""
    local(*args)
    remote(*args)
    samples: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds):
        first, second = (local, remote) if r % 2 == 0 else (remote, local)
        a, b = _timed(first, args), _timed(second, args)
        samples[0].append(a if r % 2 == 0 else b)
        samples[1].append(b if r % 2 == 0 else a)
    return statistics.median(samples[0]), statistics.median(samples[1])


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def run_demo(*, engine: str = "eager", device: str = "auto", repeats: int = 50) -> int:
    """Run the examples; returns a process exit code (0 when every result matches)."""
    torch.manual_seed(0)
    cores = os.cpu_count() or 2
    threads = max(1, cores // 2)  # the embedded worker takes the same share (see client/embedded.py)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    cases = [  # .eval() is nn.Module's (inference mode), client side; nothing is evaluated as Python
        ("mlp", models.mlp().eval(), (torch.randn(32, 784),)),
        ("cnn", models.SmallCNN().eval(), (torch.randn(8, 3, 32, 32),)),
        ("transformer block", models.TransformerBlock().eval(), (torch.randn(4, 16, 64),)),
        ("graph break (b>0)", models.bar, (torch.randn(10), torch.rand(10) + 0.1)),
        ("graph break (b<0)", models.bar, (torch.randn(10), -torch.rand(10) - 0.1)),
    ]
    print("starting the embedded worker (a real `remotorch serve` process on this machine)...", flush=True)
    ok = True
    try:
        with Session(device=device) as session:
            info = session.health()
            print(f"worker {info['name']!r}: {info['device']}, torch {info['torch_version']}, "
                  f"engines {', '.join(info['engines'])}")
            print(f"client and worker share this machine's {cores} cores: {threads} thread(s) each for "
                  f"kernels; times are medians of {repeats} rounds, local and remote alternating\n")
            compiled_bar = remote_compile(models.bar, session=session, engine=engine, fallback="raise")
            rows = []
            with bar("running the examples", len(cases), unit="items") as advance:
                for name, model, args in cases:
                    remote = compiled_bar if model is models.bar else remote_compile(
                        model, session=session, engine=engine, fallback="raise")
                    with torch.no_grad():
                        diff = _max_diff(model(*args), remote(*args))
                        local_ms, remote_ms = interleaved_ms(model, remote, args, repeats)
                    ok &= diff <= 1e-4
                    rows.append([name, f"{diff:.2e}", f"{local_ms:.3f}", f"{remote_ms:.3f}"])
                    advance(1)
            term = is_terminal()
            write(table(("model", "max |diff|", "local ms", "remote ms"), rows, indent=0,
                        title=f"engine={engine}", terminal=term), terminal=term)
            stats = session.stats()
    finally:
        torch.set_num_threads(before)
    print(f"\nsession: {stats['remote_calls']} remote calls, {stats['graphs_uploaded']} graphs and "
          f"{stats['tensors_uploaded']} weight tensors uploaded once, {stats['fallbacks']} fallbacks, "
          f"{stats['bytes_sent'] / 1e6:.2f} MB sent, {stats['bytes_received'] / 1e6:.2f} MB received")
    print("all outputs match local eager" if ok else "MISMATCH: some outputs differ from local eager")
    return 0 if ok else 1
