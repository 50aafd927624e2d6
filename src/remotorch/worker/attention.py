"""Which attention kernel torch picks on this worker's device (protocol.md §8.5).

A client traces on its own CPU, where ``scaled_dot_product_attention`` cannot take the device's
fused kernels; it asks the worker which one torch would pick for each call signature, and traces
that kernel's operator (``remotorch.capture.attention``). The answer is torch's own selection,
``torch._fused_sdp_choice``, on empty tensors of the signature on this device, with this
process's settings (enabled backends, their priority, the device's properties): what
``torch.compile`` would trace here. Each signature is answered once and remembered.
"""

from __future__ import annotations

import math

import torch

from ..codec import messages as m
from ..codec.attention import BACKENDS, MAX_CALLS
from ..codec.tensors import dtype_from_name
from ..errors import InvalidRequestError, LimitExceededError

MAX_KNOWN = 4096  # signatures remembered (the oldest is forgotten first)


class AttentionChoices:
    """The kernel torch picks here, per call signature, remembered."""

    def __init__(self, device: torch.device, max_bytes: int) -> None:
        self.device = device
        self.max_bytes = max_bytes  # the largest operand the empty tensors may take (the tensor limit)
        self._known: dict[m.AttentionCall, str] = {}

    def choose(self, calls: list[m.AttentionCall]) -> list[str]:
        """One backend name per call (``"math"`` on a device without fused kernels)."""
        if len(calls) > MAX_CALLS:
            raise LimitExceededError(f"an AttentionChoice names at most {MAX_CALLS} calls")
        answers = []
        for call in calls:
            known = self._known.get(call)
            if known is None:
                known = self._choose(call)
                if len(self._known) >= MAX_KNOWN:
                    del self._known[next(iter(self._known))]
                self._known[call] = known
            answers.append(known)
        return answers

    def _choose(self, call: m.AttentionCall) -> str:
        if not (0.0 <= call.dropout_p <= 1.0) or (call.scale is not None and not math.isfinite(call.scale)):
            raise InvalidRequestError("attention: dropout_p must be in [0, 1] and scale finite")
        operands = [self._empty(t) for t in (call.query, call.key, call.value)]
        mask = self._empty(call.mask) if call.mask is not None else None
        if self.device.type != "cuda":
            return "math"  # no fused kernels a client traces for (a CPU worker's are the client's own)
        try:
            with torch.enable_grad():
                choice = torch._fused_sdp_choice(*operands, mask, call.dropout_p, call.is_causal,
                                                 scale=call.scale, enable_gqa=call.enable_gqa)
        except RuntimeError:  # torch refuses the call itself (shapes that disagree): traced as its math
            return "math"
        return BACKENDS.get(int(choice), "math")

    def _empty(self, sig: m.TensorSig) -> torch.Tensor:
        """An uninitialised tensor of the signature on this device (checked against the tensor limit)."""
        try:
            dtype = dtype_from_name(sig.dtype)
        except ValueError as exc:
            raise InvalidRequestError(f"attention: {exc}") from None
        shape, strides = sig.shape, sig.strides
        if len(shape) != len(strides) or not 2 <= len(shape) <= 8 or not all(
                0 <= v < 1 << 40 for v in (*shape, *strides)):
            raise InvalidRequestError("attention: an operand has 2 to 8 dimensions, sizes and strides in range")
        span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        if span * dtype.itemsize > self.max_bytes:
            raise LimitExceededError(f"attention: an operand of {span * dtype.itemsize} bytes is over the "
                                     f"worker's tensor limit of {self.max_bytes}")
        device = self.device if self.device.type == "cuda" else "meta"  # (a CPU worker answers without them)
        return torch.empty_strided(shape, strides, dtype=dtype, device=device,
                                   requires_grad=sig.requires_grad and dtype.is_floating_point)


def answer(service, session, req: m.AttentionChoice, frames) -> tuple[bytes, list]:
    """The service's handler of ``AttentionChoice`` (``worker/service.py``'s ``_HANDLERS``)."""
    return m.encode(m.AttentionChoiceReply(service.worker.attention.choose(req.calls))), []
