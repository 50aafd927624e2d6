"""The inductor engine: compile the aten graph with TorchInductor for the device.

Compiled graphs are kept by inductor's own FX graph and AOT autograd caches, which the worker
points into its disk cache (``DIR/inductor``), so a restarted worker loads them instead of
compiling again.
"""

from __future__ import annotations

import torch

from .effects import without_effect_tokens


def available(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


def compile(graph, device: torch.device, example_args, artifacts=None):
    module = without_effect_tokens(graph.module).to(device)  # (dynamo cannot trace with_effects)
    dynamic = any(meta.get("kind") == "scalar" for meta in graph.inputs) or None
    compiled = torch.compile(module, backend="inductor", dynamic=dynamic, fullgraph=True)
    with torch.no_grad():
        compiled(*example_args)  # compile now, so compile time is not mixed into run timings
    return compiled


def prewarm(device: torch.device) -> None:
    """Import inductor's compiler and compile one small function (its cache then answers in this process)."""
    with torch.no_grad():
        torch.compile(lambda x: x * 2 + 1, backend="inductor", fullgraph=True)(torch.ones(8, device=device))
