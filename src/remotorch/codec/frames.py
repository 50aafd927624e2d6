"""Tensors into a message's buffer frames and back, with the bookkeeping in one place.

A message is frame 0 (the msgpack header) and then raw buffer frames; a
tensor in the header is a :class:`~remotorch.codec.messages.TensorMeta`
naming its frame by index. :class:`FrameWriter` hands out those indices as
tensors are described and collects the buffers (never copied), the way
vLLM's msgpack encoder collects auxiliary buffers; :class:`FrameReader`
views received frames as tensors again after checking the index, the size
limit and the layout. Graph inputs and outputs (tensors inline, Python
scalars) go through :meth:`FrameWriter.value` and :meth:`FrameReader.value`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..errors import LimitExceededError, ProtocolError, RemoteError, UnsupportedGraphError
from . import messages as m
from .tensors import tensor_from_wire, tensor_to_wire

SCALARS = (bool, int, float, type(None))


class FrameWriter:
    """Collects the buffer frames of one message while its header is built."""

    __slots__ = ("frames",)

    def __init__(self) -> None:
        self.frames: list = []

    def meta(self, t: torch.Tensor) -> m.TensorMeta:
        """Describe a tensor; its bytes become the next frame (a view, not a copy, when dense on CPU)."""
        meta, buf = tensor_to_wire(t, len(self.frames))
        self.frames.append(buf)
        return meta

    def tensor(self, t: torch.Tensor) -> m.TensorArg:
        """A tensor sent inline in this message."""
        return m.TensorArg(self.meta(t))

    def value(self, v) -> m.TensorArg | m.ScalarArg:
        """A graph input or output: a tensor inline, or a Python scalar (None, bool, int, float)."""
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, SCALARS):
            return m.ScalarArg(v)
        raise UnsupportedGraphError(f"a value of type {type(v).__name__} cannot travel")

    def values(self, vs: Iterable) -> list:
        return [self.value(v) for v in vs]


class FrameReader:
    """Views the buffer frames of a received message as tensors.

    ``error`` is the exception a bad reference becomes: :class:`ProtocolError`
    for a client reading a worker's reply, ``InvalidRequestError`` for a
    worker reading a request. ``max_bytes`` bounds one tensor's frame.
    """

    __slots__ = ("frames", "error", "max_bytes")

    def __init__(self, frames: Sequence, *, error: type[RemoteError] = ProtocolError,
                 max_bytes: int | None = None) -> None:
        self.frames = frames
        self.error = error
        self.max_bytes = max_bytes

    def tensor(self, meta: m.TensorMeta) -> torch.Tensor:
        """The tensor a meta describes, viewing its frame (no copy); checked before it is touched."""
        if not 0 <= meta.frame < len(self.frames):
            raise self.error("tensor names a frame the message does not have")
        buf = self.frames[meta.frame]
        if self.max_bytes is not None and buf.nbytes > self.max_bytes:
            raise LimitExceededError(f"tensor of {buf.nbytes} bytes is over the worker's limit of "
                                     f"{self.max_bytes}")
        try:
            return tensor_from_wire(meta, buf)
        except ValueError as exc:
            raise self.error(str(exc)) from None

    def value(self, arg, device: torch.device | None = None):
        """An inline argument as a value; tensors land on ``device`` (None or CPU: as received)."""
        if isinstance(arg, m.TensorArg):
            t = self.tensor(arg.meta)
            return t if device is None or device.type == "cpu" else t.to(device)
        if isinstance(arg, m.ScalarArg):
            return arg.value
        raise self.error(f"{type(arg).__name__} where a tensor or a scalar was expected")
