"""Attention traced as the kernel the worker picks: flash, memory-efficient or cuDNN attention.

This process traces on its CPU, where ``scaled_dot_product_attention`` becomes a CPU kernel or
its math; on a CUDA worker torch would run a fused kernel, with a backward of its own. So before
aot_autograd traces a dynamo graph for such a worker, each attention call becomes what torch's
composite (``aten/src/ATen/native/transformers/attention.cpp``) does on that device with the
backend the worker picks for the call's signature (asked once per signature, protocol.md §8.5):
the mask converted and aligned as there, then the fused operator. Its meta kernel and its
derivative (``_scaled_dot_product_efficient_attention_backward``…) ship with every torch build,
so aot_autograd traces it here without a kernel of it, and the graph is the one ``aot_eager``
traces on the worker's device. A call the rewrite cannot mirror keeps its math: an argument known
only when the graph runs, sizes that vary between calls (dynamic shapes), operands already on an
accelerator (this process then traces the device's own kernel), and a boolean mask for cuDNN
(whose conversion differs between torch versions).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.fx

from ..codec import messages as m
from ..codec.attention import FUSED
from ..codec.tensors import dtype_name

SDPA = torch._C._nn.scaled_dot_product_attention
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}

Choose = Callable[[list], "list[str] | None"]  # signatures -> the worker's backend for each (None: no answer)


def rewrite_attention(gm: torch.fx.GraphModule, choose: Choose) -> dict[str, int]:
    """Each attention call of a dynamo graph for which ``choose`` names a fused backend becomes that
    backend's composite (:func:`flash_attention`, :func:`efficient_attention`,
    :func:`cudnn_attention`); how many calls went to each backend (``"math"``: left as they were)."""
    found = [(node, sig) for node in gm.graph.nodes if node.op == "call_function" and node.target is SDPA
             for sig in [signature(node)] if sig is not None]
    counts: dict[str, int] = {}
    if not found:
        return counts
    backends = choose([sig for _, sig in found]) or ["math"] * len(found)
    for (node, sig), backend in zip(found, backends):
        if backend not in FUSED or (backend == "cudnn" and sig.mask is not None and sig.mask.dtype == "bool"):
            backend = "math"
        else:
            node.target = KERNELS[backend]  # same parameters as scaled_dot_product_attention
        counts[backend] = counts.get(backend, 0) + 1
    if any(b != "math" for b in counts):
        gm.recompile()
    return counts


def arguments(node: torch.fx.Node) -> dict | None:
    """The call's arguments by name (None: more than ``scaled_dot_product_attention`` takes)."""
    if len(node.args) > len(_PARAMS) or set(node.kwargs) - set(_PARAMS):
        return None
    found = dict(_DEFAULTS, **dict(zip(_PARAMS, node.args)), **node.kwargs)
    return found if all(p in found for p in _PARAMS[:3]) else None


def signature(node: torch.fx.Node) -> m.AttentionCall | None:
    """What the worker's kernel choice reads of one call (None: a call the rewrite leaves as it is)."""
    args = arguments(node)
    out = node.meta.get("example_value")
    if args is None or not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        return None
    if any(isinstance(args[p], torch.fx.Node) for p in ("dropout_p", "is_causal", "scale", "enable_gqa")):
        return None  # known only when the graph runs
    grad = out.requires_grad  # autograd records the call: an operand requires grad, gradients are on
    operands = [_tensor(args[p], grad) for p in ("query", "key", "value")]
    mask = _tensor(args["attn_mask"], grad) if args["attn_mask"] is not None else None
    if any(t is None for t in operands) or (args["attn_mask"] is not None and mask is None):
        return None
    scale = args["scale"]
    return m.AttentionCall(*operands, mask, float(args["dropout_p"]), bool(args["is_causal"]),
                           None if scale is None else float(scale), bool(args["enable_gqa"]))


def _tensor(arg, grad: bool) -> m.TensorSig | None:
    value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return None
    shape, strides = tuple(value.shape), tuple(value.stride())
    if not all(type(v) is int for v in (*shape, *strides)):
        return None  # dynamic shapes: the kernel torch picks may differ from one size to another
    return m.TensorSig(dtype_name(value.dtype), shape, strides, grad and value.requires_grad)


# ------------------------------------------------------------- what torch's composite runs
def _log_sumexp(query, key, value) -> bool:
    """``should_compute_logsumexp``: a backward will need it."""
    return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)


def _additive(mask, dtype):
    """``convert_boolean_attn_mask``: a boolean mask as 0 where it holds and -inf elsewhere."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device))


def _aligned(mask, query, key):
    """``preprocess_mask``: the memory-efficient kernel reads a bias whose rows start 8-aligned."""
    aligned = mask.stride(-1) == 1 and all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1))
    if not aligned:
        last = mask.size(-1)
        mask = torch.ops.aten.slice.Tensor(torch.ops.aten.pad.default(mask, [0, 8 - last % 8]), -1, 0, last)
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def _padded(t, alignment: int = 8):
    """``pad_last_dim<8, false>``: flash attention takes head sizes that are multiples of 8."""
    last = t.size(-1)
    return t if last % alignment == 0 else torch.ops.aten.pad.default(t, [0, alignment - last % alignment])


def efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False):
    """The memory-efficient backend: ``_scaled_dot_product_efficient_attention``."""
    mask = _additive(attn_mask, query.dtype)
    if mask is not None:
        mask = _aligned(mask, query, key)
    return torch.ops.aten._scaled_dot_product_efficient_attention.default(
        query, key, value, mask, _log_sumexp(query, key, value), dropout_p, is_causal, scale=scale)[0]


def flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """The flash backend on CUDA: ``_scaled_dot_product_flash_attention`` on head sizes padded to 8,
    scaled for the head size it was given, its output cut back to it."""
    head = query.size(-1)
    scale = scale if scale is not None else 1.0 / math.sqrt(head)  # sdp::calculate_scale, in double
    out = torch.ops.aten._scaled_dot_product_flash_attention.default(
        _padded(query), _padded(key), _padded(value), dropout_p, is_causal, False, scale=scale)[0]
    return torch.ops.aten.slice.Tensor(out, -1, 0, head) if out.size(-1) != head else out


def cudnn_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """The cuDNN backend: ``_scaled_dot_product_cudnn_attention`` (an additive mask as it is)."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention.default(
        query, key, value, attn_mask, _log_sumexp(query, key, value), dropout_p, is_causal, False,
        scale=scale)[0]


KERNELS: dict[str, Callable] = {"flash": flash_attention, "efficient": efficient_attention,
                                "cudnn": cudnn_attention}
#: the fused operators and their backwards: no CPU kernel, so a graph holding one runs only on its worker
DEVICE_ONLY = frozenset(f"aten::_scaled_dot_product_{k}_attention{b}" for k in ("flash", "efficient", "cudnn")
                        for b in ("", "_backward"))


def device_only(gm: torch.fx.GraphModule) -> bool:
    """Whether an aten graph calls a fused attention operator (it cannot run on this CPU)."""
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target._schema.name in DEVICE_ONLY for n in gm.graph.nodes)
