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


class HandlesArg(msgspec.Struct, frozen=True, tag="hs", array_like=True):
    """``count`` consecutive arguments: the handles ``first``, ``first + 1``, … (a backward's saved
    activations, named in one entry instead of one each)."""

    first: int
    count: int


class SlotsArg(msgspec.Struct, frozen=True, tag="ps", array_like=True):
    """``len(ids)`` consecutive arguments: these parameter slots (a forward's parameters, named in
    one entry instead of one each)."""

    ids: list[int]


MAX_RUN_ARGS = 1 << 16  # arguments a Run may stand for, runs expanded


def expand(args: list) -> list:
    """A ``Run``'s arguments with each run of handles or slots written out (at most ``MAX_RUN_ARGS``)."""
    kinds = set(map(type, args))
    if HandlesArg not in kinds and SlotsArg not in kinds:
        return args
    out = []
    for a in args:
        kind = type(a)
        if kind is HandlesArg:
            if a.count < 0 or a.first < 0 or len(out) + a.count > MAX_RUN_ARGS:
                raise ValueError(f"a run of {a.count} handles from {a.first} does not fit a Run")
            out.extend(HandleArg(a.first + k) for k in range(a.count))
        elif kind is SlotsArg:
            if len(out) + len(a.ids) > MAX_RUN_ARGS:
                raise ValueError(f"a run of {len(a.ids)} slots does not fit a Run")
            out.extend(SlotArg(sid) for sid in a.ids)
        else:
            out.append(a)
    return out


def compact(args: list, least: int = 3) -> list:
    """``args`` with each run of at least ``least`` handles of consecutive ids at consecutive
    positions written as one :class:`HandlesArg`, and each run of slots as one :class:`SlotsArg`."""
    kinds = set(map(type, args))
    if HandleArg not in kinds and SlotArg not in kinds:
        return args  # (most runs: nothing to compact)
    out, i, n = [], 0, len(args)
    while i < n:
        a = args[i]
        kind = type(a)
        if kind is HandleArg or kind is SlotArg:
            j = i + 1
            while j < n and type(args[j]) is kind and (kind is SlotArg or args[j].id == a.id + (j - i)):
                j += 1
            if j - i >= least:
                out.append(HandlesArg(a.id, j - i) if kind is HandleArg else SlotsArg([b.id for b in args[i:j]]))
                i = j
                continue
        out.append(a)
        i += 1
    return out


class ZerosArg(msgspec.Struct, frozen=True, tag="z", array_like=True):
    """A tensor of zeros, by its layout alone: the gradient autograd makes up for an output that
    got none (a backward's tangent), which need not travel as bytes. Empty ``strides``: row-major."""

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
RunArg = Union[TensorArg, RefArg, ScalarArg, HandleArg, SlotArg, ViewArg, ZerosArg, HandlesArg, SlotsArg]
OutputArg = Union[TensorArg, ScalarArg, HandleArg, KeptArg, EchoArg]
