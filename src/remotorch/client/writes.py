"""A received value into a placeholder's own buffer, as an internal write (no version bump)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch._ops import _len_torch_dispatch_stack_pre_dispatch as _len_pre_dispatch
from torch.utils._python_dispatch import _disable_current_modes


def write(t: Tensor, value: Tensor) -> None:
    """The value into a placeholder's buffer: an internal write, outside any dispatch mode, that
    bumps no version counter (the tensor may be saved for backward). A placeholder made under
    ``torch.inference_mode`` is an inference tensor: written in that mode (it has no counter)."""
    if 0 in t.stride():  # an expanded layout (an expand's output): each memory location once
        t, value = _unexpanded(t, value)
    if not torch._C._len_torch_dispatch_stack() and not _len_pre_dispatch():
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
    with _disable_current_modes(), torch._C.DisableTorchFunctionSubclass(), torch._C._DisableTorchDispatch():
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
