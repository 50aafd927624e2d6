"""Placeholders made and made real: the local stand-in for a value a worker keeps (or a launched
call's reply brings), and filling it when the value is here.

What a placeholder is and how it behaves is in :mod:`remotorch.client.remote`.
"""

from __future__ import annotations

import math
import weakref

import torch

from ..codec import messages as m
from ..codec.tensors import dtype_from_name
from .remote import _EAGER, Connection, RemoteRef, RemoteTensor, Tensor, _dynamo_hooks
from .writes import modes_off
from .writes import write as _write


def placeholder(conn: Connection, kept: m.KeptArg, device: torch.device | None, policy=None,
                index: int = -1, launched=None, cls: type = None, dtype: torch.dtype | None = None) -> RemoteTensor:
    """A local stand-in for the tensor the worker kept (or, launched, will keep) as ``kept.id``.

    ``kept.id`` 0: a value the reply of ``launched`` brings (it fills the
    placeholder then). ``cls``: :class:`RemoteGrad` for a backward's outputs.
    """
    return stand_in(conn, kept.id, kept.shape, kept.strides, dtype or dtype_from_name(kept.dtype),
                    device if device is not None else _CPU, policy, index, launched, cls or RemoteTensor)


def stand_in(conn: Connection, hid: int, shape, strides, dtype: torch.dtype, device: torch.device, policy,
             index: int, launched, cls: type = RemoteTensor) -> RemoteTensor:
    """:func:`placeholder` from the layout itself (a prepared run's: :mod:`remotorch.client.prepared`)."""
    if not _EAGER:
        _dynamo_hooks()
    t = torch.Tensor._make_subclass(cls, torch.empty_strided(shape, strides, dtype=dtype, device=device), False)
    ref = t._rt_ref = RemoteRef(hid, conn, policy, index, launched)
    ref.root = weakref.ref(t)
    if hid:
        ref.nbytes = math.prod(shape) * dtype.itemsize  # (not t.nbytes: that is an op on a placeholder)
        conn.handles.track(ref)
    return t


_CPU = torch.device("cpu")
_ADOPT_BYTES = 1 << 16  # below it a copy costs less than taking over the buffer


def fill(t: RemoteTensor, value: Tensor) -> None:
    """Make a placeholder an ordinary tensor holding ``value`` (its call sent it back after all);
    its views, which share its buffer, become ordinary too. A placeholder nothing views takes the
    received buffer itself (no copy) when it is large."""
    ref = t.__dict__.get("_rt_ref")
    if not (ref is not None and not ref.views and "_rt_base" not in t.__dict__ and value.nbytes >= _ADOPT_BYTES
            and _adopt(t, value)):
        _write(t, value)
    ref = t.__dict__.pop("_rt_ref", None)
    if ref is not None:
        ref.launched = None
        for view in ref.views:
            v = view()
            if v is not None:
                for key in ("_rt_ref", "_rt_base", "_rt_view"):
                    v.__dict__.pop(key, None)


def _adopt(t: RemoteTensor, value: Tensor) -> bool:
    """Give ``t`` the storage of ``value`` (same dtype and sizes), as an internal write that bumps no
    version counter; False when it cannot (an inference tensor, another device or dtype...)."""
    with modes_off(), torch._C.DisableTorchFunctionSubclass(), torch._C._DisableTorchDispatch():
        if t.is_inference() or value.dtype != t.dtype or value.device != t.device or value.shape != t.shape:
            return False
        try:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t):
                t.set_(value.untyped_storage(), value.storage_offset(), value.shape, value.stride())
        except RuntimeError:
            return False
    return True
