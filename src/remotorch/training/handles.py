"""Local placeholders for tensors that stay on the worker (activations saved for backward).

A forward graph's saved-for-backward outputs stay on the worker as *handles*.
aot_autograd's runtime only checks that each saved value is a tensor, detaches
views, tags dynamic dimensions as an attribute, and hands the saved values to
the backward graph untouched (torch 2.11 through 2.13), so a placeholder can
be an ordinary empty tensor carrying its handle id as an attribute: autograd
saves it like any tensor and returns the same object to the backward (a saved
tensor that is neither an input nor an output of the autograd function is
kept as is). When autograd frees it (after ``backward()`` without
``retain_graph``, or when the graph is dropped) a weakref callback queues the
id, and the next training request tells the worker to drop those handles:
freeing costs no round trip of its own.

Handle ids are chosen here, per session, and never reused, so a placeholder
that outlives a lost connection can never name another tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..client.handles import HandleTable

_HANDLE_ATTR = "_remotorch_handle"
_CALL_ATTR = "_remotorch_call"


@dataclass
class ForwardCall:
    """What one forward run tells its backward: the slots, by input index, whose gradients stay
    on the worker (those an optimizer there manages)."""

    n_inputs: int
    slots: dict[int, int] = field(default_factory=dict)
    params: dict[int, torch.Tensor] = field(default_factory=dict)  # the local tensors of ``slots``
    backward_of: ForwardCall | None = None  # when this run is a backward: the forward it differentiates


def handle_of(t: object) -> int | None:
    """The handle id of a placeholder, None for any other value."""
    return getattr(t, _HANDLE_ATTR, None) if isinstance(t, torch.Tensor) else None


def call_of(t: torch.Tensor) -> ForwardCall | None:
    """The forward call a placeholder came from."""
    return getattr(t, _CALL_ATTR, None)


def placeholder(table: HandleTable, hid: int, call: ForwardCall) -> torch.Tensor:
    """An empty tensor standing for activation handle ``hid`` (reserved from ``table``); its death
    releases the handle."""
    t = torch.empty(0)
    setattr(t, _HANDLE_ATTR, hid)
    setattr(t, _CALL_ATTR, call)
    table.held_by(t, hid)
    return t
