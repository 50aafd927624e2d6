"""A module whose weights exist only as metadata here: building it, and finding the tensors to fill.

:func:`init_empty_weights` builds a module with its parameters and persistent
buffers on ``meta`` (no memory, no initialisation cost) and its
non-persistent buffers real: those are not in any checkpoint (a rotary
embedding's ``inv_freq``, a causal mask), so they are computed here as the
module's own ``__init__`` computes them, and uploaded by content id when a
graph first needs them. This is accelerate's ``init_empty_weights`` with one
difference: persistent buffers go to ``meta`` too, since they come from the
checkpoint.

:func:`tensors_of` lists what a checkpoint must fill: each distinct
parameter or persistent buffer once, with every place it is registered
(tied weights are one tensor with several names) and every key it may be
saved under.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

_lock = threading.Lock()


@contextmanager
def init_empty_weights() -> Iterator[None]:
    """Build modules with parameters and persistent buffers on ``meta`` (non-persistent buffers real).

    ::

        with remotorch.init_empty_weights():
            model = MyModel()          # no weight memory here
        remotorch.load_state_dict(model, "models/my-model.safetensors")   # the worker reads them

    The patch is process-wide while the block runs (modules made on other
    threads meanwhile are built the same way), as accelerate's is.
    """
    with _lock:
        register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

        def on_meta_parameter(module, name, param):
            if param is not None and param.device.type != "meta":
                param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            register_parameter(module, name, param)

        def on_meta_buffer(module, name, tensor, persistent=True):
            if persistent and tensor is not None and tensor.device.type != "meta":
                tensor = tensor.to("meta")
            register_buffer(module, name, tensor, persistent=persistent)

        nn.Module.register_parameter, nn.Module.register_buffer = on_meta_parameter, on_meta_buffer
        try:
            yield
        finally:
            nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer


@dataclass(frozen=True)
class Place:
    """Where a tensor is registered: ``module._parameters[name]`` or ``module._buffers[name]``."""

    module: nn.Module
    name: str
    parameter: bool


@dataclass
class Weight:
    """One distinct tensor of a module that a checkpoint fills, with all its places and keys."""

    tensor: torch.Tensor
    places: list[Place] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # its state_dict keys, in the module's order

    @property
    def parameter(self) -> bool:
        return self.places[0].parameter

    @property
    def requires_grad(self) -> bool:
        return self.parameter and self.tensor.requires_grad


def tensors_of(module: nn.Module) -> list[Weight]:
    """Every parameter and persistent buffer of ``module`` once, in ``state_dict`` order."""
    found: dict[int, Weight] = {}
    seen: set[tuple[int, str]] = set()
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for kind, table in ((True, mod._parameters), (False, mod._buffers)):
            for name, t in table.items():
                if t is None or (not kind and name in mod._non_persistent_buffers_set):
                    continue
                w = found.setdefault(id(t), Weight(t))
                if (id(mod), name) not in seen:
                    seen.add((id(mod), name))
                    w.places.append(Place(mod, name, kind))
                key = f"{prefix}.{name}" if prefix else name
                if key not in w.keys:
                    w.keys.append(key)
    return list(found.values())


def install(weight: Weight, value: torch.Tensor) -> None:
    """Register ``value`` in every place of ``weight`` (tied places get the one same object)."""
    for place in weight.places:
        (place.module._parameters if place.parameter else place.module._buffers)[place.name] = value


def meta_buffers(module: nn.Module) -> list[str]:
    """Non-persistent buffers still on ``meta``: no checkpoint holds them, so nothing can fill them."""
    return [f"{prefix}.{name}" if prefix else name for prefix, mod in module.named_modules()
            for name, t in mod._buffers.items()
            if t is not None and name in mod._non_persistent_buffers_set and t.device.type == "meta"]
