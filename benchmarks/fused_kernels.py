"""Which operators of the conformance zoo a CUDA worker would run as another kernel than this CPU traces.

A client traces on its CPU. Where an operator is CompositeImplicitAutograd, torch decomposes it
while tracing, and its decomposition may depend on the device: then the graph a CPU traces is not
the graph ``aot_eager`` traces on the worker's GPU. ``scaled_dot_product_attention`` is one (flash,
memory-efficient or cuDNN attention on CUDA; the CPU's flash kernel or its math here): remotorch
asks the worker and traces its kernel (``remotorch.capture.attention``). This sweep looks for the
others: it captures every model of the zoo (``remotorch.devtools.zoo``) in every mode with dynamo,
collects the torch functions its graphs call, and lists each that is a composite aten operator,
with what torch 2.13 does on CUDA for it where its composite branches on the device
(``DEVICE_CHOICES``, read from torch's sources) and how many models call it. An operator not in
that table has no device branch known here: a GPU run that traces the same cases with
``aot_eager`` on CUDA and compares the operators is what confirms it (owed: it needs a GPU).

Usage::

    python benchmarks/fused_kernels.py [--models GPT2LMHeadModel,...]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from remotorch.devtools import zoo
from remotorch.devtools.conformance import synthetic_loss

# composite operators whose decomposition torch 2.13 chooses by device, and what remotorch does
DEVICE_CHOICES = {
    "scaled_dot_product_attention": "CUDA: flash / efficient / cuDNN attention (torch._fused_sdp_choice); "
                                    "remotorch asks the worker and traces that kernel",
    "rms_norm": "CUDA: _fused_rms_norm (CPU: its math); not rewritten (the zoo's models compute RMS norm "
                "themselves, not with this operator)",
    "ctc_loss": "CUDA: _cudnn_ctc_loss when cuDNN can take the call; not rewritten",
    "lstm": "CUDA: _cudnn_rnn; dynamo does not capture RNN modules (graph break): runs locally",
    "gru": "CUDA: _cudnn_rnn; dynamo does not capture RNN modules (graph break): runs locally",
    "rnn_tanh": "CUDA: _cudnn_rnn; as lstm",
    "_native_multi_head_attention": "CUDA: the fast path's fused kernels (inference); not rewritten",
    "dropout": "CUDA: native_dropout (the fused kernel); aot_autograd traces native_dropout and its backward "
               "on this CPU too: the same",
    "group_norm": "the same operators; the CPU makes the input contiguous in its own memory format, CUDA "
                  "row-major (differs for channels-last inputs only)",
}


def aten_name(target) -> str | None:
    """The aten operator a dynamo graph's call target is (None: not one)."""
    name = getattr(target, "__name__", None)
    module = getattr(target, "__module__", None) or ""
    if name is None:
        return None
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.removeprefix("aten::")
    if module.startswith("torch") and hasattr(torch.ops.aten, name):
        return name
    if module == "torch.nn.functional" and hasattr(torch.ops.aten, name):
        return name
    return None


def composite(name: str) -> bool:
    """Whether an overload of the aten operator decomposes while traced (CompositeImplicitAutograd)."""
    for overload in getattr(torch.ops.aten, name).overloads():
        full = f"aten::{name}" + ("" if overload == "default" else f".{overload}")
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key(full, "CompositeImplicitAutograd"):
                return True
        except RuntimeError:  # an overload TorchScript knows, not the dispatcher (``tanh.int``)
            continue
    return False


def calls_of(spec, mode: str) -> set[str]:
    """The aten operators the dynamo graphs of one case call."""
    seen: set[str] = set()

    def collect(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and (name := aten_name(node.target)) is not None:
                seen.add(name)
        return gm.forward

    torch._dynamo.reset()
    model = spec.build().train(mode == "train")
    compiled = torch.compile(model, backend=collect)
    inputs = spec.inputs()
    if mode == "train":
        extra = spec.labels(inputs) if spec.labels else {}
        out = compiled(**inputs, **extra)
        (out.loss if spec.labels else synthetic_loss(out)).backward()
    else:
        with torch.no_grad():
            compiled(**inputs)
    torch._dynamo.reset()
    return seen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="")
    args = p.parse_args()
    names = [n for n in args.models.split(",") if n] or [s.name for s in zoo.suite()]
    users: dict[str, set[str]] = defaultdict(set)
    for name in names:
        spec = zoo.by_name(name)
        for mode in ("forward", "train"):
            try:
                for op in calls_of(spec, mode):
                    users[op].add(name)
            except Exception as exc:  # reported; the sweep goes on
                print(f"{name} {mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", file=sys.stderr)
    found = sorted(op for op in users if composite(op))
    print(f"composite aten operators the zoo's graphs call ({len(names)} models, forward and training):\n")
    print(f"{'operator':<36} {'models':>6}  on CUDA")
    for op in found:
        print(f"{op:<36} {len(users[op]):>6}  {DEVICE_CHOICES.get(op, 'no device branch known')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
