"""How a message names tensors and values: the tensor layout of a buffer frame and the arguments
and outputs of a graph call (protocol.md §7.1, §8.1).

They live beside :mod:`remotorch.codec.messages`, whose messages
carry them; import them from there (``m.TensorArg``).
"""

from __future__ import annotations

from typing import Union

import msgspec


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    """How to view one buffer frame as a tensor: dtype, shape, strides (elements)."""

    dtype: str
    shape: list[int]
    strides: list[int]
    frame: int  # index into the message's buffer frames (0 = first after the header)


# ----------------------------------------------------------------- call arguments
class TensorArg(msgspec.Struct, frozen=True, tag="t", array_like=True):
    """A tensor sent inline in this message's frames."""

    meta: TensorMeta


class RefArg(msgspec.Struct, frozen=True, tag="r", array_like=True):
    """A tensor already held by the worker, named by its content id."""

    id: str


class ScalarArg(msgspec.Struct, frozen=True, tag="s", array_like=True):
    """A Python scalar (int, float, bool or None): symbolic sizes, unwrapped numbers."""

    value: Union[int, float, bool, None]


class HandleArg(msgspec.Struct, frozen=True, tag="h", array_like=True):
    """A tensor the worker keeps for this session (a saved activation), by handle id."""

    id: int


class SlotArg(msgspec.Struct, frozen=True, tag="p", array_like=True):
    """A trainable parameter the worker keeps for this session, by slot id."""

    id: int


class ViewArg(msgspec.Struct, frozen=True, tag="v", array_like=True):
    """A view of a handle's tensor: sizes, strides and offset in elements, within its storage."""

    id: int
    shape: list[int]
    strides: list[int]
    offset: int


class ZerosArg(msgspec.Struct, frozen=True, tag="z", array_like=True):
    """A tensor of zeros, by its layout alone: the gradient autograd makes up for an output that
    got none (a backward's tangent), which need not travel as bytes."""

    dtype: str
    shape: list[int]
    strides: list[int]


class KeptArg(msgspec.Struct, frozen=True, tag="k", array_like=True):
    """An output the worker kept as handle ``id`` (instead of sending it), with its layout."""

    id: int
    dtype: str
    shape: list[int]
    strides: list[int]


class EchoArg(msgspec.Struct, frozen=True, tag="e", array_like=True):
    """An output the worker kept as handle ``id`` and also sent inline (``meta``: its frame): the
    client reads it from the reply, and may name it by handle before the reply has come."""

    id: int
    meta: TensorMeta


Arg = Union[TensorArg, RefArg, ScalarArg]
RunArg = Union[TensorArg, RefArg, ScalarArg, HandleArg, SlotArg, ViewArg, ZerosArg]
OutputArg = Union[TensorArg, ScalarArg, HandleArg, KeptArg, EchoArg]
