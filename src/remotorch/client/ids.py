"""Content ids of resident tensors (weights, buffers), computed once per local value; what a local value is.

A local value is known by its *stamp*: the tensor's version counter and the
address of its data. In-place ops bump the counter; ``p.data = other`` swaps
the storage without bumping it, and moves the address. A write through
``p.data`` in place (``p.data.mul_(…)``) moves neither: that one is
announced with :func:`remotorch.mark_changed` (see ``training/writes.py``).
"""

from __future__ import annotations

import weakref

import torch

from ..codec.tensors import content_id, tensor_to_wire


def stamp(t: torch.Tensor) -> tuple[int, int]:
    """What moves when a tensor's local value may have changed: ``(version, data address)``."""
    try:
        return t._version, t.data_ptr()
    except RuntimeError:  # no storage (sparse and other layouts): the version alone
        return t._version, 0


class ContentIds:
    """Content ids of resident tensors (weights, buffers), remembered until a tensor changes.

    Warm calls then cost one dict lookup per weight: the id is kept by the
    tensor's identity and :func:`stamp`, so an in-place change (which bumps
    ``_version``) or a swapped storage makes the next lookup hash it again. Shared by the
    connections of a session, so each tensor is hashed once for all workers.
    """

    def __init__(self) -> None:
        self._by_tensor: dict[int, tuple[weakref.ref, tuple[int, int], str]] = {}

    def get(self, t: torch.Tensor) -> tuple[str, str | None]:
        """(the tensor's content id, the id it had before when its content changed since, else None)."""
        entry = self._by_tensor.get(id(t))
        if entry is not None and entry[0]() is t:
            if entry[1] == stamp(t):
                return entry[2], None
            previous = entry[2]
        else:
            previous = None
        meta, buf = tensor_to_wire(t, 0)
        tid = content_id(meta, buf)
        key = id(t)

        def forget(ref, key=key, cache=self._by_tensor):
            if cache.get(key, (None,))[0] is ref:  # a newer tensor may have taken the same id()
                del cache[key]

        self._by_tensor[key] = (weakref.ref(t, forget), stamp(t), tid)
        return tid, (previous if previous != tid else None)

    def current(self, t: torch.Tensor) -> str | None:
        """The id already known for exactly this local value, without hashing; None if unknown."""
        entry = self._by_tensor.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == stamp(t):
            return entry[2]
        return None
