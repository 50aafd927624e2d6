"""Which attention kernel a worker picks (protocol.md §8.5): asked once per call signature at capture.

A client traces on its own CPU; where torch would run ``scaled_dot_product_attention`` as a fused
kernel on the worker's device (flash, memory-efficient or cuDNN attention), the client asks the
worker which one, for each signature, and traces that kernel's aten operator. They live beside
:mod:`remotorch.codec.messages`, which takes them into its ``Request`` and ``Reply`` unions;
import them from there (``m.AttentionChoice``).
"""

from __future__ import annotations

from typing import Union

import msgspec

#: SDPBackend's values (``torch.nn.attention.SDPBackend``) as the wire names them
BACKENDS = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
FUSED = ("flash", "efficient", "cudnn")  # the backends a client traces as their own operator
MAX_CALLS = 256  # signatures in one AttentionChoice


class TensorSig(msgspec.Struct, frozen=True, array_like=True):
    """``[dtype, shape, strides, requires_grad]`` of one operand (what the kernel choice reads of it)."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    requires_grad: bool = False


class AttentionCall(msgspec.Struct, frozen=True, array_like=True):
    """One ``scaled_dot_product_attention`` call's signature: its operands and its arguments.

    ``requires_grad`` is what autograd would see: False for every operand of a call made while
    gradients are off. ``scale`` nil: the default, 1/sqrt(head size).
    """

    query: TensorSig
    key: TensorSig
    value: TensorSig
    mask: Union[TensorSig, None] = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: Union[float, None] = None
    enable_gqa: bool = False


class AttentionChoice(msgspec.Struct, frozen=True, tag="attention_choice", omit_defaults=True):
    """Ask which attention kernel torch would pick on the worker's device for each call (answered
    ``AttentionChoiceReply``)."""

    calls: list[AttentionCall]


class AttentionChoiceReply(msgspec.Struct, frozen=True, tag="attention_choice_reply", omit_defaults=True):
    """One backend name per call, in order (:data:`BACKENDS`); ``"math"`` on a device without fused
    kernels (a CPU worker: the client's own CPU trace is the worker's)."""

    backends: list[str]
