"""A received value written while another thread traces before dispatch (an eager call's first trace).

torch keeps its pre-dispatch modes in one stack for the whole process. A
value written into a placeholder (a reply read in any thread) once set
"the current modes" aside with torch's ``_disable_current_modes``: that took
the tracing thread's mode away for a moment, then put it back marking the
*writing* thread as one that dispatches through it. From then on every op of
that thread met whichever thread traced next (the full suite's cascade:
"Cannot reenter make_fx", eager calls run here, a crash).
"""

from __future__ import annotations

import threading

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from remotorch.client import writes

PRE_DISPATCH = torch._C.DispatchKey.PreDispatch


def pre_dispatch_here() -> bool:
    return torch._C._dispatch_tls_is_dispatch_key_included(PRE_DISPATCH)


def trace_held_open(inside: threading.Event, go: threading.Event, out: dict) -> threading.Thread:
    """A thread tracing ``x * 2 + 1`` before dispatch, held between its two ops until ``go``."""
    def fn(x):
        y = x * 2
        inside.set()
        assert go.wait(60)
        return y + 1

    def run() -> None:
        try:
            out["graph"] = make_fx(fn, pre_dispatch=True)(torch.randn(3))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_write_while_another_thread_traces_before_dispatch_leaves_both_threads_as_they_were():
    inside, go, out = threading.Event(), threading.Event(), {}
    thread = trace_held_open(inside, go, out)
    try:
        assert inside.wait(60)
        t, value = torch.zeros(4), torch.arange(4.0)
        writes.write(t, value)  # (the process has a pre-dispatch mode: another thread's)
    finally:
        go.set()
        thread.join(60)
    assert "error" not in out, out.get("error")
    assert torch.equal(t, value)
    assert not pre_dispatch_here()  # this thread does not dispatch through another's tracer
    ops = [str(n.target) for n in out["graph"].graph.nodes if n.op == "call_function"]
    assert ops == ["aten.mul.Tensor", "aten.add.Tensor"], ops  # and the trace missed nothing
    assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))


class Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_modes_off_while_another_thread_traces_before_dispatch_takes_nothing_of_its_trace():
    inside, go, out = threading.Event(), threading.Event(), {}
    thread = trace_held_open(inside, go, out)
    try:
        assert inside.wait(60)
        with writes.modes_off():
            u = torch.ones(2) * 3
    finally:
        go.set()
        thread.join(60)
    assert "error" not in out, out.get("error")
    assert torch.equal(u, torch.full((2,), 3.0)) and not pre_dispatch_here()
    ops = [str(n.target) for n in out["graph"].graph.nodes if n.op == "call_function"]
    assert ops == ["aten.mul.Tensor", "aten.add.Tensor"], ops


def test_modes_off_sets_this_threads_own_modes_aside_and_puts_them_back():
    with Counting() as mode:
        with writes.modes_off():
            torch.ones(2).add_(1)
        assert mode.calls == 0
        torch.ones(2).add_(1)
        assert mode.calls == 2  # (ones, add_): back on the stack after the block
    assert torch._C._len_torch_dispatch_stack() == 0

