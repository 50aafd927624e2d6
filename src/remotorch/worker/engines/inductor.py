"""The inductor engine: compile the aten graph with TorchInductor for the device."""

from __future__ import annotations

import torch


def available(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


def compile(graph, device: torch.device, example_args, artifacts=None):
    module = graph.module.to(device)
    dynamic = any(meta.get("kind") == "scalar" for meta in graph.inputs) or None
    compiled = torch.compile(module, backend="inductor", dynamic=dynamic, fullgraph=True)
    with torch.no_grad():
        compiled(*example_args)  # compile now, so compile time is not mixed into run timings
    return compiled
