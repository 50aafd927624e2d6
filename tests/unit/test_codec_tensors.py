"""Unit tests of the tensor wire form: (dtype, shape, strides) + one raw byte frame."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from remotorch.codec.messages import TensorMeta
from remotorch.codec.tensors import (content_id, dtype_from_name, dtype_name, tensor_from_wire,
                                     tensor_to_wire)
from remotorch.errors import UnsupportedGraphError

ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
              torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128]
ALL_DTYPES += [getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                                           "complex32") if hasattr(torch, n)]


def sample(dtype: torch.dtype, shape=(3, 4)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:  # (complex32 has no random generator of its own)
        return torch.randn(shape, dtype=torch.complex64, generator=g).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return torch.randint(0, 200, shape, generator=g, dtype=torch.int64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The values of ``t`` in row-major order, as bytes (bitwise comparison, NaN-safe)."""
    flat = t.contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def through_wire(t: torch.Tensor, kind: str = "bytes") -> tuple[TensorMeta, torch.Tensor]:
    """Encode, copy the frame the way a socket would deliver it, decode."""
    meta, buf = tensor_to_wire(t, 0)
    meta = TensorMeta(meta.dtype, list(meta.shape), list(meta.strides), meta.frame)
    if kind == "bytes":  # read-only buffer: the receiver must copy
        frame = bytes(buf)
    else:  # a writable uint8 array, as the transport hands over
        frame = np.frombuffer(bytearray(bytes(buf)), dtype=np.uint8)
    return meta, tensor_from_wire(meta, frame)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert raw_bytes(a) == raw_bytes(b)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["bytes", "ndarray"])
def test_round_trip_every_dtype(dtype, kind):
    t = sample(dtype)
    meta, back = through_wire(t, kind)
    assert meta.dtype == dtype_name(dtype)
    assert dtype_from_name(meta.dtype) is dtype
    assert_bitwise(back, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_zero_dim(dtype):
    t = sample(dtype, ())
    meta, back = through_wire(t)
    assert meta.shape == [] and meta.strides == []
    assert back.dim() == 0
    assert_bitwise(back, t)


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0, 2)])
def test_empty(shape):
    t = torch.empty(shape)
    meta, buf = tensor_to_wire(t, 0)
    assert len(buf) == 0
    back = tensor_from_wire(meta, b"")
    assert back.shape == t.shape and back.dtype == t.dtype


def test_nan_and_inf_survive_bitwise():
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45])
    assert_bitwise(through_wire(t)[1], t)


def test_transposed_keeps_its_strides():
    base = sample(torch.float32, (3, 5))
    t = base.t()
    meta, back = through_wire(t)
    assert meta.strides == [1, 5]
    assert back.stride() == t.stride()
    assert torch.equal(back, t)


def test_channels_last_keeps_its_layout():
    t = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    meta, back = through_wire(t)
    assert list(meta.strides) == list(t.stride())
    assert back.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(back, t)


@pytest.mark.parametrize("make", [
    lambda b: b[::2],
    lambda b: b[:, 1::3],
    lambda b: b[1:, 2:],
    lambda b: b[0],
    lambda b: b[:, 0],
    lambda b: b.unsqueeze(0).expand(3, -1, -1),
    lambda b: b.diagonal(),
], ids=["rows-step", "cols-step", "offset", "row", "column", "expanded", "diagonal"])
def test_non_contiguous_views(make):
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    t = make(base)
    meta, back = through_wire(t)
    assert torch.equal(back, t)
    span = 1 + sum((n - 1) * s for n, s in zip(meta.shape, meta.strides)) if back.numel() else 0
    assert span * 4 == len(bytes(tensor_to_wire(t, 0)[1]))  # the frame holds exactly the layout


def test_conjugate_and_negative_views_are_resolved():
    z = torch.randn(4, dtype=torch.complex64)
    assert torch.equal(through_wire(z.conj())[1], z.conj().resolve_conj())
    neg = z.conj().imag  # a negative-bit view
    assert torch.equal(through_wire(neg)[1], neg.clone())


def test_storage_offset_is_not_sent():
    base = torch.arange(100, dtype=torch.int32)
    t = base[90:]
    meta, buf = tensor_to_wire(t, 0)
    assert len(buf) == 10 * 4
    assert torch.equal(tensor_from_wire(meta, bytes(buf)), t)


def test_gradient_tensors_are_detached():
    t = torch.randn(3, requires_grad=True)
    meta, back = through_wire(t * 2)
    assert not back.requires_grad
    assert torch.equal(back, (t * 2).detach())


def test_a_zero_tensor_travels_as_zeros():
    # what autograd gives for a gradient known to be zero (sgn's): it has no memory of its own
    for shape in [(2, 3), (), (0, 4)]:
        z = torch._efficientzerotensor(shape, dtype=torch.float32)
        assert z._is_zerotensor()
        meta, back = through_wire(z)
        assert not back._is_zerotensor()
        assert_bitwise(back, torch.zeros(shape))


def test_frame_index_is_recorded():
    meta, _ = tensor_to_wire(torch.zeros(2), 7)
    assert meta.frame == 7


def test_unsupported_dtype_is_refused():
    with pytest.raises(UnsupportedGraphError):
        dtype_name(torch.quint8)
    with pytest.raises(ValueError):
        dtype_from_name("object")


# ------------------------------------------------------------ hostile metadata
@pytest.mark.parametrize("meta, nbytes", [
    (TensorMeta("float32", [4], [1], 0), 15),  # one byte short
    (TensorMeta("float32", [4], [1], 0), 17),  # one byte too many
    (TensorMeta("float32", [2, 2], [100, 1], 0), 16),  # strides reach past the frame
    (TensorMeta("float32", [2, 2], [2, 1], 0), 32),  # frame larger than the layout
    (TensorMeta("int64", [3], [1], 0), 12),  # itemsize ignored
    (TensorMeta("float32", [4], [1, 1], 0), 16),  # shape and strides disagree
    (TensorMeta("float32", [4, 4], [4], 0), 64),
    (TensorMeta("float32", [-4], [1], 0), 16),  # negative size
    (TensorMeta("float32", [4], [-1], 0), 16),  # negative stride
    (TensorMeta("float32", [1 << 62], [1], 0), 16),  # huge size
    (TensorMeta("float32", [2, 1 << 62], [1 << 62, 1], 0), 16),
    (TensorMeta("float32", [1] * 65, [1] * 65, 0), 4),  # absurd rank
    (TensorMeta("no-such-dtype", [4], [1], 0), 16),
    (TensorMeta("__import__('os')", [4], [1], 0), 16),
])
def test_inconsistent_meta_is_rejected(meta, nbytes):
    with pytest.raises(ValueError):
        tensor_from_wire(meta, bytes(nbytes))


@pytest.mark.parametrize("shape, strides", [([0, 1 << 70], [1, 1]), ([1 << 64, 0], [1, 1])])
def test_empty_shape_with_oversized_dimension_is_rejected(shape, strides):
    with pytest.raises(ValueError):
        tensor_from_wire(TensorMeta("float32", shape, strides, 0), b"")


def test_view_stays_inside_the_frame():
    """Accepted metadata never lets the view reach past the frame's bytes."""
    frame = np.arange(64, dtype=np.uint8)
    t = tensor_from_wire(TensorMeta("uint8", [4, 4], [16, 4], 0), frame[:61])
    assert t.max().item() <= 60
    assert t[3, 3].item() == 60


def test_content_id_follows_the_protocol_formula():
    import hashlib

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    meta, buf = tensor_to_wire(t, 5)
    expected = hashlib.sha256(b"float32|[3, 4]|[4, 1]|" + t.numpy().tobytes()).hexdigest()
    assert content_id(meta, buf) == expected
    scalar_meta, scalar_buf = tensor_to_wire(torch.tensor(2.5), 0)
    assert content_id(scalar_meta, scalar_buf) == hashlib.sha256(
        b"float32|[]|[]|" + torch.tensor(2.5).numpy().tobytes()).hexdigest()


def test_content_id_depends_on_dtype_shape_strides_and_bytes():
    t = torch.arange(6, dtype=torch.float32)
    ids = {content_id(*tensor_to_wire(x, 0)) for x in (
        t, t.reshape(2, 3), t.reshape(3, 2).t(), t.view(torch.int32), t + 1)}
    assert len(ids) == 5
    assert content_id(*tensor_to_wire(t, 0)) == content_id(*tensor_to_wire(t.clone(), 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool, torch.complex64,
                                   torch.bfloat16])
@pytest.mark.parametrize("shape,strides", [([32, 784], [784, 1]), ([], []), ([3, 1], [1, 1]),
                                           ([3, 1], [1, 5]), ([2, 3], [1, 2]), ([4], [1])])
def test_received_tensor_views_the_frame_with_the_exact_layout(dtype, shape, strides):
    """Row-major frames take a numpy fast path; every path gives the meta's exact strides, shares the
    frame's memory, and is a base of its own (no autograd view, so a graph may write it in place)."""
    from remotorch.codec.tensors import _ITEMSIZE, tensor_from_wire
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    frame = np.arange(span * _ITEMSIZE[dtype], dtype=np.uint8)
    t = tensor_from_wire(TensorMeta(dtype_name(dtype), shape, strides, 0), frame)
    assert t.dtype == dtype and list(t.shape) == shape and list(t.stride()) == strides
    assert not t._is_view() and not t.requires_grad
    assert t.untyped_storage().data_ptr() == frame.ctypes.data
    want = torch.from_numpy(frame.copy()).view(dtype).as_strided(shape, strides)
    def raw(x):  # the elements' bytes (NaN patterns compare too)
        return x.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(raw(t), raw(want))
    t.add_(1) if dtype not in (torch.bool,) else t.logical_not_()  # in place on the frame: allowed


@pytest.mark.parametrize("make, strides, nbytes", [
    (lambda: torch.tensor(3.0).expand(3, 4), [0, 0], 4),  # one element, seen 12 times
    (lambda: torch.randn(1, 5).expand(4, 5), [0, 1], 20),
    (lambda: torch.randn(4, 1).expand(4, 6), [1, 0], 16),
    (lambda: torch.randn(2, 1, 3).expand(2, 5, 3), [3, 0, 1], 24),
    (lambda: torch.randn(3).expand(2, 3).t(), [1, 0], 12),
    (lambda: torch.randn(2, 3, dtype=torch.complex64)[:, :1].expand(2, 4), [4, 1], 64),  # gaps too: made contiguous
    (lambda: torch.randn(3, 1).expand(3, 2)[::2], [2, 1], 16),
])
def test_an_expanded_tensor_travels_as_each_element_once_with_its_strides(make, strides, nbytes):
    t = make()
    meta, buf = tensor_to_wire(t, 0)
    assert (meta.strides, len(buf)) == (strides, nbytes)
    back = tensor_from_wire(meta, bytes(buf))
    assert torch.equal(back, t) and back.stride() == tuple(strides)
