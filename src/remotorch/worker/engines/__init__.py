"""Worker engines: each turns a decoded aten graph into a callable for a device.

An engine is a module with ``compile(graph: DecodedGraph, device, example_args)
-> callable`` and ``available(device) -> bool``. Engines import their heavy
dependencies inside ``compile``, so a worker lists only what really loads.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

ENGINE_MODULES = {
    "eager": "remotorch.worker.engines.eager",
    "inductor": "remotorch.worker.engines.inductor",
    "onnxrt": "remotorch.worker.engines.onnxrt",
    "tensorrt": "remotorch.worker.engines.tensorrt",
    "failing": "remotorch.worker.engines.failing",
}
# Engines a worker offers only when asked by name (``remotorch serve --engines``).
HIDDEN = frozenset({"failing"})


def load(name: str) -> ModuleType:
    """The engine module for a name; KeyError for unknown engines."""
    return importlib.import_module(ENGINE_MODULES[name])


def available(device: torch.device) -> list[str]:
    """Names of the engines that can run on this device here."""
    names = []
    for name in ENGINE_MODULES:
        if name in HIDDEN:
            continue
        try:
            if load(name).available(device):
                names.append(name)
        except Exception:  # an engine whose dependencies fail to import is just absent
            continue
    return names
