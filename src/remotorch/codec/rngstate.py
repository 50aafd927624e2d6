"""How a random generator's state travels: in full, or as the bytes that changed (protocol.md §17.5).

A CPU generator's state is 5,056 bytes (torch's mt19937 and what it caches);
after a few draws only a handful of them differ, after 624 draws most do. A
change is a list of ``[offset, bytes]`` runs to write over the state the
receiver holds; ``[[-1, state]]`` is a whole state.
"""

from __future__ import annotations

import numpy as np


def delta(before: bytes, after: bytes, gap: int = 8) -> list[list]:
    """``after`` as changes to ``before`` (runs of changed bytes closer than ``gap`` are merged)."""
    if len(before) != len(after):
        return [[-1, bytes(after)]]
    changed = np.flatnonzero(np.frombuffer(before, np.uint8) != np.frombuffer(after, np.uint8))
    if not len(changed):
        return []
    breaks = np.flatnonzero(np.diff(changed) > gap)
    starts = [changed[0], *changed[breaks + 1]]
    ends = [*changed[breaks], changed[-1]]
    return [[int(a), bytes(after[a:b + 1])] for a, b in zip(starts, ends)]


def patched(before: bytes, changes: list) -> bytes:
    """``before`` with :func:`delta`'s changes written over it (ValueError: a change outside it)."""
    if changes and changes[0][0] == -1:
        return bytes(changes[0][1])
    buf = bytearray(before)
    for offset, data in changes:
        if not (0 <= offset and offset + len(data) <= len(buf)):
            raise ValueError("a generator state change outside the state")
        buf[offset:offset + len(data)] = data
    return bytes(buf)


def draws_random(gm) -> bool:
    """Whether a graph (or a subgraph it calls) draws from a random generator: it calls an operator
    torch tags ``nondeterministic_seeded`` (dropout, ``rand``, ``bernoulli``, ``randperm``…), unless
    that call cannot draw (see :func:`_draws`)."""
    import torch

    for module in gm.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            target = node.target
            if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
                    and torch.Tag.nondeterministic_seeded in target.tags and _draws(node, target):
                return True
    return False


def _draws(node, target) -> bool:
    """False for a call of a seeded operator that draws nothing, as the graph says: attention with a
    ``dropout_p`` of 0 (every attention kernel; a model in eval mode calls them so), a dropout
    with ``train`` False, or a fused attention kernel's backward (it replays its forward's draws
    from the seed and offset the forward saved). (A dropout with p 0 in training still draws: it
    is kept.)"""
    if target._schema.name.startswith("aten::_scaled_dot_product") and target._schema.name.endswith("_backward"):
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name not in ("dropout_p", "train"):
            continue
        if i < len(node.args):
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            return True
        if arg.name == "dropout_p" and type(value) in (int, float) and value == 0:
            return False
        if arg.name == "train" and value is False:
            return False
    return True
