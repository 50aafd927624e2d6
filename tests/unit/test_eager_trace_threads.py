"""An eager call's first trace beside compiled calls in other threads.

FX's "tracing now" flag is one for the whole process, and dynamo reads it at
every call of a compiled function: while it is set, a compiled call in any
thread raises "using FX to symbolically trace a dynamo-optimized function"
(pytorch#126024). An eager call on a kept value is traced in the thread that
makes it, the first time its kind is seen (``remotorch.capture.eager``): a
program whose other threads call compiled models meanwhile must not fail.
"""

from __future__ import annotations

import threading

import torch
import torch.fx._symbolic_trace as fx_trace

from remotorch.capture import eager
from remotorch.client.eager import flatten


def test_a_compiled_call_in_another_thread_runs_while_an_eager_call_is_traced():
    compiled = torch.compile(lambda a: a * 3 + 1, backend="eager")
    x = torch.randn(5)
    assert torch.equal(compiled(x), x * 3 + 1)  # compiled before: the call below compiles nothing
    inside, go, out = threading.Event(), threading.Event(), {}

    def held_open(t):  # the traced call, held open inside its trace until the test has called
        inside.set()
        assert go.wait(60)
        return t * 2

    def trace() -> None:
        try:
            leaves, shape = flatten((x,), {})
            out["graph"] = eager._traced(held_open, leaves, shape, [0], [x], {})[0]
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=trace)
    thread.start()
    try:
        assert inside.wait(60)
        during = compiled(x)  # in this thread, while the other traces
    finally:
        go.set()
        thread.join(60)
    assert "error" not in out, out.get("error")
    assert torch.equal(during, x * 3 + 1)
    ops = [str(n.target) for n in out["graph"].graph.nodes if n.op == "call_function"]
    assert ops == ["aten.mul.Tensor"], ops
    assert fx_trace._is_fx_tracing_flag is False
