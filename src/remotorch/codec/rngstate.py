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
    torch tags ``nondeterministic_seeded`` (dropout, ``rand``, ``bernoulli``, ``randperm``…)."""
    import torch

    for module in gm.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            target = node.target
            if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
                    and torch.Tag.nondeterministic_seeded in target.tags:
                return True
    return False
