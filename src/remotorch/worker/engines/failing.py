"""The failing engine: a debugging aid whose compile always fails.

Never offered unless a worker is started with it by name
(``remotorch serve --engines eager,failing``). It lets tests and users see
how a backend that cannot take a graph is reported, without depending on
which graphs a real engine happens to refuse.
"""

from __future__ import annotations

import torch


def available(device: torch.device) -> bool:
    return True


def compile(graph, device: torch.device, example_args, artifacts=None):
    raise NotImplementedError("the failing engine refuses every graph (a debugging aid)")
