"""Tensors as (dtype, shape, strides) plus one raw byte buffer.

Dense tensors (contiguous or a permutation of it) travel as the exact bytes of
the storage span they cover, with their strides, so the receiver rebuilds the
same layout without a copy. Anything else is made contiguous first. A
ZeroTensor (what autograd gives for a gradient known to be zero, e.g. that
of ``sgn``) has no memory: it travels as the zeros it stands for.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..errors import UnsupportedGraphError
from .messages import TensorMeta

_DTYPES: dict[str, torch.dtype] = {
    name: dt for name, dt in {
        "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
        "bfloat16": torch.bfloat16, "int8": torch.int8, "int16": torch.int16,
        "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
        "bool": torch.bool, "complex64": torch.complex64, "complex128": torch.complex128,
        "complex32": getattr(torch, "complex32", None),
        "uint16": getattr(torch, "uint16", None), "uint32": getattr(torch, "uint32", None),
        "uint64": getattr(torch, "uint64", None),
        "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
        "float8_e5m2": getattr(torch, "float8_e5m2", None),
    }.items() if dt is not None
}
_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _DTYPES.items()}
DTYPE_NAMES = frozenset(_DTYPES)
_ITEMSIZE: dict[torch.dtype, int] = {dt: dt.itemsize for dt in _NAMES}
# dtypes numpy can view directly (the fast path of tensor_to_wire)
_NUMPY_VIEWABLE = frozenset({torch.float32, torch.float64, torch.float16, torch.int8, torch.int16,
                             torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
                             torch.complex128})
_NUMPY_DTYPE = {dt: torch.empty((), dtype=dt).numpy().dtype for dt in _NUMPY_VIEWABLE}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a dtype; raises UnsupportedGraphError for dtypes with no wire form."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise UnsupportedGraphError(f"dtype {dtype} cannot travel on the wire") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; unknown names raise ``ValueError``."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None


def is_permuted_contiguous(shape, strides) -> bool:
    """True when the strides are a permutation of a contiguous layout (no gaps, no overlap)."""
    expected = 1
    for size, stride in sorted((p for p in zip(shape, strides) if p[0] != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _dense_span(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D contiguous view over the storage a dense tensor covers, or None."""
    if t.is_contiguous():
        return t.reshape(-1)
    if not is_permuted_contiguous(t.shape, t.stride()):
        return None
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return torch.as_strided(t, (span,), (1,), t.storage_offset())


def tensor_to_wire(t: torch.Tensor, frame: int) -> tuple[TensorMeta, memoryview]:
    """Describe a tensor and expose its bytes without copying (when it is dense on CPU)."""
    t = t.detach()
    if (t.is_cpu and t.is_contiguous() and t.dtype in _NUMPY_VIEWABLE and not t.is_conj()
            and not t.is_neg() and t.numel() and not t._is_zerotensor()):  # the common case, a few times cheaper
        return (TensorMeta(_NAMES[t.dtype], list(t.shape), list(t.stride()), frame),
                memoryview(t.numpy()).cast("B"))
    if t._is_zerotensor():  # no storage to send: the zeros it stands for
        t = torch.zeros(t.shape, dtype=t.dtype)
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    name = dtype_name(t.dtype)
    flat = _dense_span(t) if t.numel() else t.new_empty(0)
    if flat is None and 0 in t.stride():  # expanded: each element once, its layout kept (stride 0)
        base = t
        for d, (n, st) in enumerate(zip(t.shape, t.stride())):
            if st == 0 and n > 1:
                base = base.narrow(d, 0, 1)
        if is_permuted_contiguous(base.shape, base.stride()):  # (a view of one element: any strides)
            span = 1 + sum((n - 1) * st for n, st in zip(base.shape, base.stride()))
            flat = torch.as_strided(base, (span,), (1,), base.storage_offset())
            meta = TensorMeta(name, list(t.shape), list(t.stride()), frame)
            return meta, memoryview((flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat).numpy()).cast("B")
    if flat is None:
        t = t.contiguous()
        flat = t.reshape(-1)
    strides = list(t.stride()) if t.numel() else contiguous_strides(t.shape)
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    meta = TensorMeta(name, list(t.shape), strides, frame)
    return meta, memoryview(raw.numpy()).cast("B")


def contiguous_strides(shape) -> list[int]:
    """The strides of a contiguous tensor of this shape (elements)."""
    strides, acc = [], 1
    for n in reversed(list(shape)):
        strides.append(acc)
        acc *= max(int(n), 1)
    return strides[::-1]


_LIMIT = 1 << 62


def tensor_from_wire(meta: TensorMeta, buf) -> torch.Tensor:
    """View a received buffer (bytes, memoryview or uint8 ndarray) as the described tensor.

    Validates that shape and strides fit inside the buffer; raises ``ValueError``
    otherwise, so a hostile header cannot make the receiver read out of bounds.
    """
    dtype = dtype_from_name(meta.dtype)
    shape, strides = meta.shape, meta.strides
    if len(shape) != len(strides) or len(shape) > 64:
        raise ValueError("tensor meta: shape and strides disagree")
    numel = span = extent = expected = 1
    row_major = True  # the strides are exactly the contiguous ones of the shape
    for i in range(len(shape) - 1, -1, -1):  # (one pass: this runs for every tensor received)
        n, st = shape[i], strides[i]
        if type(n) is not int or type(st) is not int or not 0 <= n < _LIMIT or not 0 <= st < _LIMIT:
            raise ValueError("tensor meta: size or stride out of range")
        numel *= n
        span += (n - 1) * st
        extent *= n or 1
        if st != expected:
            row_major = False
        expected *= n
    if extent >= _LIMIT:  # torch refuses such sizes even for an empty tensor
        raise ValueError("tensor meta: sizes multiply out of range")
    if numel == 0:
        return torch.empty_strided(shape, strides, dtype=dtype)
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if span * _ITEMSIZE[dtype] != arr.nbytes:
        raise ValueError(f"tensor meta: layout needs {span * _ITEMSIZE[dtype]} bytes, frame has {arr.nbytes}")
    np_dtype = _NUMPY_DTYPE.get(dtype)
    if np_dtype is not None and row_major and arr.flags.writeable:
        # the common case, several times cheaper: numpy views the frame with the layout, and the
        # tensor over it is a base of its own (no autograd view), as the general path's detach makes it
        return torch.from_numpy(arr.view(np_dtype).reshape(shape))
    base = torch.from_numpy(arr) if arr.flags.writeable else torch.frombuffer(bytearray(arr), dtype=torch.uint8)
    base = base.view(dtype) if dtype is not torch.uint8 else base
    # detached: the same memory, but no autograd view of the frame, so a graph output may be
    # written in place as one computed here may (autograd refuses that on a view's output)
    return torch.as_strided(base, shape, strides, 0).detach()


def content_id(meta: TensorMeta, data: memoryview) -> str:
    """Content hash of a tensor: dtype, shape, strides and bytes (sha256, hex)."""
    h = hashlib.sha256()
    h.update(f"{meta.dtype}|{meta.shape}|{meta.strides}|".encode())
    h.update(data)
    return h.hexdigest()
