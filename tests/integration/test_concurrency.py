"""Several clients on one worker at once: threads with their own sessions, and other processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import torch

import remotorch
from remotorch import models

from conftest import TOKEN, clean_env

CALLS = 30

CLIENT_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import remotorch
    from remotorch import models

    url, token, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(100 + len(kind))
    if kind == "mlp":
        model, shape = models.mlp().eval(), (16, 784)
    else:
        model, shape = models.SmallCNN().eval(), (2, 3, 32, 32)
    with remotorch.Session(url, token=token) as session:
        compiled = remotorch.compile(model, session=session, fallback="raise")
        with torch.no_grad():
            for i in range(int(sys.argv[4])):
                x = torch.randn(shape)
                out = compiled(x)
                if not torch.equal(out, model(x)):
                    sys.exit(f"{kind}: call {i} differs from eager")
        stats = session.stats()
    assert stats["remote_calls"] == int(sys.argv[4]), stats
    assert stats["graphs_uploaded"] == 1 and stats["fallbacks"] == 0, stats
    print("CLIENT-OK", kind, stats["remote_calls"])
""")


def _workloads():
    """(name, model-or-function, input maker) for the four threads."""
    torch.manual_seed(11)
    return [
        ("mlp", models.mlp().eval(), lambda: (torch.randn(8, 784),)),
        ("cnn", models.SmallCNN().eval(), lambda: (torch.randn(2, 3, 32, 32),)),
        ("block", models.TransformerBlock().eval(), lambda: (torch.randn(2, 8, 64),)),
        ("bar", models.bar, lambda: (torch.randn(7), torch.randn(7))),
    ]


def test_threads_and_processes_share_one_worker(server, make_session):
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, server.url, TOKEN, kind, str(CALLS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
             for kind in ("mlp", "cnn")]
    failures: list[str] = []
    counts: dict[str, int] = {}
    barrier = threading.Barrier(4)
    compiling = threading.Lock()

    def client(name, fn, make_args, session):
        try:
            compiled = remotorch.compile(fn, session=session, fallback="raise")
            # Each thread compiles (its first calls, both branches of the graph
            # break) one at a time before the concurrent phase: while one thread
            # traces, torch's FX tracing flag is process-wide, and another
            # thread entering a compiled function then fails inside torch
            # (pytorch/pytorch#126024; any aot_autograd backend, inductor too).
            with compiling, torch.no_grad():
                args = make_args()
                compiled(*args)
                if name == "bar":
                    compiled(args[0], -args[1].abs() - 1)
                    compiled(args[0], args[1].abs() + 1)
            barrier.wait(timeout=120)
            for i in range(CALLS):
                args = make_args()
                with torch.no_grad():
                    out = compiled(*args)
                    expected = fn(*args)
                if not torch.equal(out, expected):
                    failures.append(f"{name}: call {i} differs from eager")
                    return
            counts[name] = session.stats()["remote_calls"]
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(f"{name}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(name, fn, make, make_session()), name=f"client-{name}")
               for name, fn, make in _workloads()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a client thread hung"
        assert failures == []
        assert counts["mlp"] == counts["cnn"] == counts["block"] == CALLS + 1
        assert counts["bar"] >= 2 * CALLS  # the graph break: two remote graphs per call
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            assert "CLIENT-OK" in out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert server.alive()
