"""Weights that live on the worker: loaded from its operator's folders, saved there, never here.

* :func:`from_pretrained`: a transformers model built here on meta, its weights read by the worker;
* :func:`load_state_dict`: the same for any module (built under :func:`init_empty_weights`);
* :func:`save`: a module (as ``save_pretrained`` writes it) or a ``RemoteOptimizer``'s state, written
  by the worker under a ``--checkpoints`` root.

The worker's side: :mod:`remotorch.worker.weights`; the requests: docs/protocol.md §22.
"""

from __future__ import annotations

from .hf import from_pretrained
from .load import load_state_dict as _load_module
from .meta import init_empty_weights
from .save import load_optimizer, save


def load_state_dict(obj, source: str, *, session=None, strict: bool = True, revision: str | None = None):
    """Fill a module's weights from ``source``, read by the worker (see :func:`remotorch.weights.load.load_state_dict`),
    or resume a ``RemoteOptimizer`` from a file :func:`save` wrote."""
    from ..training.optim import RemoteOptimizer

    if isinstance(obj, RemoteOptimizer):
        return load_optimizer(obj, source, revision)
    return _load_module(obj, source, session=session, strict=strict, revision=revision)


__all__ = ["from_pretrained", "init_empty_weights", "load_state_dict", "save"]
