"""The messages of training state kept on the worker (protocol.md §17): parameter slots, gradients
and optimizers.

They live beside :mod:`remotorch.codec.messages`, which takes them into its
``Request`` and ``Reply`` unions; import them from there (``m.OptimStep``).
"""

from __future__ import annotations

from typing import Union

import msgspec

from .args import HandleArg, RefArg, ScalarArg, TensorArg, TensorMeta, ViewArg

# Saved activations, trainable parameters and optimizers stay on the worker,
# in the session; the client names them by small integers it chooses itself
# (never reused within a client session, so a stale id can never name new state).
Hyper = Union[int, float, bool, None, str, list[Union[int, float, bool]]]


class BindSlots(msgspec.Struct, frozen=True, tag="bind_slots", omit_defaults=True):
    """Set parameter slots (created if new) from uploaded content (RefArg), inline tensors, or values
    the session keeps (HandleArg: the slot shares that tensor's memory; ViewArg: a copy of the view)."""

    slots: list[int]
    values: list[Union[TensorArg, RefArg, HandleArg, ViewArg]]


class AccumulateGrads(msgspec.Struct, frozen=True, tag="accumulate_grads", omit_defaults=True):
    """Add gradients computed on the client (frames) into parameter slots' gradients."""

    slots: list[int]
    metas: list[TensorMeta]


class PullSlots(msgspec.Struct, frozen=True, tag="pull_slots", omit_defaults=True):
    """Ask for the current values (and gradients) of parameter slots."""

    slots: list[int]
    grads: bool = False


class OptimCreate(msgspec.Struct, frozen=True, tag="optim_create", omit_defaults=True):
    """Create ``torch.optim.<name>`` on the worker over slots, one list per parameter group."""

    optim: int
    name: str
    groups: list[list[int]]
    hyper: list[dict[str, Hyper]]


class OptimStep(msgspec.Struct, frozen=True, tag="optim_step", omit_defaults=True):
    """Set changed hyperparameters per group (``hyper[i]`` for group i), then ``step()``."""

    optim: int
    hyper: list[dict[str, Hyper]] = []


class OptimZeroGrad(msgspec.Struct, frozen=True, tag="optim_zero_grad", omit_defaults=True):
    """``zero_grad(set_to_none)`` of a worker-side optimizer."""

    optim: int
    set_to_none: bool = True


class ClipGradNorm(msgspec.Struct, frozen=True, tag="clip_grad_norm", omit_defaults=True):
    """``torch.nn.utils.clip_grad_norm_`` over an optimizer's parameters; answers the norm."""

    optim: int
    max_norm: float
    norm_type: float = 2.0
    error_if_nonfinite: bool = False


class OptimGetState(msgspec.Struct, frozen=True, tag="optim_get_state", omit_defaults=True):
    """Ask for an optimizer's per-parameter state (for a checkpoint)."""

    optim: int


class OptimSetState(msgspec.Struct, frozen=True, tag="optim_set_state", omit_defaults=True):
    """Replace an optimizer's per-parameter state; ``entries`` as in :class:`OptimStateReply`."""

    optim: int
    entries: list[tuple[int, str, Union[TensorArg, ScalarArg]]]


class OptimStateReply(msgspec.Struct, frozen=True, tag="optim_state_reply", omit_defaults=True):
    """Per-parameter optimizer state: ``[parameter index, key, value]`` entries, tensors in frames.

    The parameter index counts the optimizer's parameters group by group, as
    ``torch.optim.Optimizer.state_dict()`` does.
    """

    entries: list[tuple[int, str, Union[TensorArg, ScalarArg]]]


class PullReply(msgspec.Struct, frozen=True, tag="pull_reply", omit_defaults=True):
    """Slot values (and gradients, nil where none) as tensors in frames."""

    values: list[TensorMeta]
    grads: list[Union[TensorMeta, None]] = []


class NormReply(msgspec.Struct, frozen=True, tag="norm_reply", omit_defaults=True):
    norm: float
