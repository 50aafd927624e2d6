"""Graph inputs and outputs as wire arguments: tensors into frames, scalars inline, and back."""

from __future__ import annotations

import torch

from ..errors import InvalidRequestError, ProtocolError
from . import messages as m
from .tensors import tensor_from_wire, tensor_to_wire


def value_to_arg(value, frames: list) -> m.TensorArg | m.ScalarArg:
    """One graph output as an argument; a tensor's bytes are appended to ``frames`` (not copied)."""
    if isinstance(value, torch.Tensor):
        meta, buf = tensor_to_wire(value, len(frames))
        frames.append(buf)
        return m.TensorArg(meta)
    if value is None or isinstance(value, (bool, int, float)):
        return m.ScalarArg(value)
    raise InvalidRequestError(f"graph returned a {type(value).__name__}, which cannot travel")


def values_to_args(values) -> tuple[list, list]:
    """Every output as arguments, and the frames their tensors travel in."""
    frames: list = []
    return [value_to_arg(v, frames) for v in values], frames


def arg_to_value(arg, frames: list, device: torch.device | None):
    """An output argument of a reply as a value; tensors land on ``device`` (None: as received)."""
    if isinstance(arg, m.TensorArg):
        t = tensor_from_wire(arg.meta, frames[arg.meta.frame])
        return t if device is None or device.type == "cpu" else t.to(device)
    if isinstance(arg, m.ScalarArg):
        return arg.value
    raise ProtocolError("worker answered a run with a tensor reference")
