"""The inductor engine: compile the aten graph with TorchInductor for the device.

Compiled graphs are kept by inductor's own FX graph and AOT autograd caches, which the worker
points into its disk cache (``DIR/inductor``), so a restarted worker loads them instead of
compiling again.
"""

from __future__ import annotations

import copy

import torch
import torch.fx

from .effects import without_effect_tokens


def available(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


def compile(graph, device: torch.device, example_args, artifacts=None):
    module = _reshapes(without_effect_tokens(graph.module)).to(device)  # (dynamo cannot trace with_effects)
    dynamic = any(meta.get("kind") == "scalar" for meta in graph.inputs) or None
    compiled = torch.compile(module, backend="inductor", dynamic=dynamic, fullgraph=True)
    with torch.no_grad():
        compiled(*example_args)  # compile now, so compile time is not mixed into run timings
    return compiled


def _reshapes(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy whose ``view`` calls are ``reshape`` (the graph is functional: the same values).

    A view is valid only for the strides its input had when the graph was traced. Inductor traces
    the graph again and may lay an intermediate out otherwise (a ``cat`` with an empty operand
    becomes its other operand, transposed), and a view of it then fails. ``reshape`` views where
    it can and copies where it must; views a mutation writes through are left as they are.
    """
    view, reshape = torch.ops.aten.view.default, torch.ops.aten.reshape.default
    nodes = [n for n in module.graph.nodes if n.op == "call_function" and n.target is view
             and not any(_mutates(u) for u in n.users)]
    if not nodes:
        return module
    graph = copy.deepcopy(module.graph)
    for n in graph.nodes:
        if n.op == "call_function" and n.target is view and not any(_mutates(u) for u in n.users):
            n.target = reshape
    return torch.fx.GraphModule(module, graph)


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and (schema is None or schema.is_mutable)


def prewarm(device: torch.device) -> None:
    """Import inductor's compiler and compile one small function (its cache then answers in this process)."""
    with torch.no_grad():
        torch.compile(lambda x: x * 2 + 1, backend="inductor", fullgraph=True)(torch.ones(8, device=device))
