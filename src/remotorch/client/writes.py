"""A received value into a placeholder's own buffer, as an internal write (no version bump); and
:func:`modes_off`, this thread's dispatch modes set aside (another thread's left as they are)."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes, _pop_mode, _push_mode

_PRE_DISPATCH = torch._C.DispatchKey.PreDispatch


def _pre_dispatch_here() -> bool:
    """Whether this thread dispatches through torch's pre-dispatch modes (it is tracing with them)."""
    return torch._C._dispatch_tls_is_dispatch_key_included(_PRE_DISPATCH)


@contextlib.contextmanager
def modes_off():
    """This thread's torch dispatch modes set aside for the block (a fake tensor mode, a tracer's).

    torch's ``_disable_current_modes`` also pops the pre-dispatch modes, which
    are one stack for the whole process, and pushes them back on exit, which
    marks *this* thread as dispatching through them. Run in a thread that is
    not tracing while another traces before dispatch (an eager call's first
    trace, :mod:`remotorch.capture.eager`), it takes that trace's mode away
    for a moment and leaves this thread routed to whatever pre-dispatch mode
    comes next, for good (later ops of this thread then meet another thread's
    tracer). Here a thread that is not tracing before dispatch pops only its
    own modes.
    """
    if _pre_dispatch_here():
        with _disable_current_modes():
            yield
        return
    old = [_pop_mode() for _ in range(torch._C._len_torch_dispatch_stack())]
    try:
        yield
    finally:
        for mode in reversed(old):
            _push_mode(mode)


def write(t: Tensor, value: Tensor) -> None:
    """The value into a placeholder's buffer: an internal write, outside any dispatch mode, that
    bumps no version counter (the tensor may be saved for backward). A placeholder made under
    ``torch.inference_mode`` is an inference tensor: written in that mode (it has no counter)."""
    if 0 in t.stride():  # an expanded layout (an expand's output): each memory location once
        t, value = _unexpanded(t, value)
    if not torch._C._len_torch_dispatch_stack() and not _pre_dispatch_here():
        # the common case, without the context managers (their Python costs more than the copy)
        with torch._C.DisableTorchFunctionSubclass(), torch._C._DisableTorchDispatch():  # (RemoteGrad's)
            if not t.is_inference():
                version, grad = t._version, torch.is_grad_enabled()
                torch._C._set_grad_enabled(False)
                try:
                    t.copy_(value)
                finally:
                    torch._C._set_grad_enabled(grad)
                    torch._C._autograd._unsafe_set_version_counter((t,), (version,))
                return
    with modes_off(), torch._C.DisableTorchFunctionSubclass(), torch._C._DisableTorchDispatch():
        if t.is_inference():
            with torch.inference_mode():
                t.copy_(value)
        else:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t):
                t.copy_(value)


def _unexpanded(t: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """``t`` and ``value`` narrowed to the first index of each dimension ``t`` repeats (stride 0): a
    write then touches each memory location once (copy_ refuses overlapping destinations)."""
    with torch._C.DisableTorchFunctionSubclass(), torch._C._DisableTorchDispatch():
        for d, (n, st) in enumerate(zip(t.shape, t.stride())):
            if st == 0 and n > 1:
                t, value = t.narrow(d, 0, 1), value.narrow(d, 0, 1)
    return t, value
