"""A decoded graph without its effect tokens, for engines that trace it again with torch.compile.

aot_autograd runs an operator with a side effect (``aten._linalg_check_errors``,
which raises when ``linalg.cholesky``, ``inv`` or ``solve`` met a singular
matrix) as ``with_effects(token, op, *args)``, with tokens made by
``prims._make_token`` and sunk by ``prims._sink_tokens`` (see
``torch/_higher_order_ops/effects.py``). The eager engine runs that as it is.
Dynamo cannot trace the ``with_effects`` higher-order operator, but it does
not need to: tracing the plain operator, aot_autograd wraps it in
``with_effects`` again, because torch registers its effect. So an engine that
compiles the graph with ``torch.compile`` (inductor) compiles this copy, where
each ``with_effects`` call is its operator's call, in the same place, and the
tokens are gone: what it compiles is what torch would have compiled from the
user's program.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ...errors import UnsupportedGraphError


def without_effect_tokens(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module`` itself when it has no ``with_effects`` call; otherwise a copy without effect tokens
    (its constants shared, not copied)."""
    with_effects = torch.ops.higher_order.with_effects
    if not any(n.op == "call_function" and n.target is with_effects for n in module.graph.nodes):
        return module
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is with_effects:
            _unwrap(graph, node)
    for node in list(graph.nodes):  # the tokens' ends, then their beginnings (now unused)
        if node.op == "call_function" and node.target is torch.ops.prims._sink_tokens.default:
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.prims._make_token.default and not node.users:
            graph.erase_node(node)
    graph.lint()
    return torch.fx.GraphModule(module, graph)


def _unwrap(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """``with_effects(token, op, *args, **kwargs)`` -> ``op(*args, **kwargs)``: its ``[0]`` (the new
    token) becomes the token it took, its ``[i]`` the operator's ``[i - 1]`` (or the operator's one
    result)."""
    token, op, *args = node.args
    with graph.inserting_before(node):
        call = graph.call_function(op, tuple(args), dict(node.kwargs))
    several = len(op._schema.returns) > 1
    for user in list(node.users):
        if not (user.op == "call_function" and user.target is operator.getitem and len(user.args) == 2):
            raise UnsupportedGraphError("a with_effects result is used other than by its items")
        index = user.args[1]
        if index == 0:
            user.replace_all_uses_with(token)
        elif several:
            with graph.inserting_before(user):
                user.replace_all_uses_with(graph.call_function(operator.getitem, (call, index - 1)))
        else:
            user.replace_all_uses_with(call)
        graph.erase_node(user)
    graph.erase_node(node)
