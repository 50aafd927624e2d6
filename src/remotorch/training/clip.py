"""``torch.nn.utils.clip_grad_norm_`` where the gradients live on a worker.

With a :class:`~remotorch.training.optim.RemoteOptimizer`, gradients
accumulate on the worker and the local ``p.grad`` stays ``None``: torch's own
``clip_grad_norm_`` would find no gradients, answer a norm of 0 and clip
nothing, so training would quietly differ from torch's. remotorch therefore
wraps ``torch.nn.utils.clip_grad_norm_`` (once per process, like the
optimizer step hooks of :mod:`remotorch.training.writes`):

* parameters no ``RemoteOptimizer`` manages: torch's own function, unchanged;
* the parameters of one ``RemoteOptimizer`` (any order): its
  ``clip_grad_norm_`` on the worker (the norm stands here at once; nothing
  waits unless it is read);
* the parameters of several: each one's norm, the total here (a read), then
  one scale for all, as torch computes it;
* a mix, or only part of an optimizer's parameters: a ``ValueError`` that says
  why (torch's result would need gradients that are on the worker, and
  others that are not).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

_managed: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(param) -> (param, its RemoteOptimizer)
_lock = threading.Lock()
_original: list = []


def manage(optimizer, params: Iterable[torch.Tensor]) -> None:
    """Record that ``optimizer`` (a RemoteOptimizer) keeps these parameters' gradients on its worker."""
    with _lock:
        for p in params:
            _managed[id(p)] = (weakref.ref(p), weakref.ref(optimizer))


def _owner(p: torch.Tensor):
    entry = _managed.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, also over gradients that live on a worker (module docstring)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = [_owner(p) for p in params]
    if not any(o is not None for o in owners):
        return _original[0](params, max_norm, norm_type, error_if_nonfinite, foreach)
    optimizers = list({id(o): o for o in owners if o is not None}.values())
    covered = {id(p) for o in optimizers for p in o._params()}
    if None in owners or covered != {id(p) for p in params}:
        raise ValueError(
            "clip_grad_norm_ over parameters whose gradients are partly on a worker (a RemoteOptimizer "
            "keeps them there) and partly here, or over part of a RemoteOptimizer's parameters: call it "
            "over exactly the parameters of your RemoteOptimizer(s), or use opt.clip_grad_norm_()")
    if len(optimizers) == 1:
        return optimizers[0].clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
    norms = [o.clip_grad_norm_(float("inf"), norm_type) for o in optimizers]  # each one's norm, nothing clipped
    total = torch.linalg.vector_norm(torch.stack([n.reshape(()) for n in norms]), float(norm_type))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:  # torch's scale, as each optimizer's own clip applies it: its norm times coef
        for o, n in zip(optimizers, norms):
            o.clip_grad_norm_(float(n) * coef, norm_type)
    return total


def install() -> None:
    """Put :func:`clip_grad_norm_` in place of torch's (once per process)."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    with _lock:
        if not _original:
            _original.append(clip_grad.clip_grad_norm_)
            clip_grad_norm_.__wrapped__ = clip_grad.clip_grad_norm_  # type: ignore[attr-defined]
            utils.clip_grad_norm_ = clip_grad_norm_
            clip_grad.clip_grad_norm_ = clip_grad_norm_
