"""Local writes to parameters and buffers that torch does not count: made visible to remotorch.

remotorch knows a local tensor changed by its stamp (version counter and data
address, :func:`remotorch.client.ids.stamp`): a changed weight is uploaded
again (or its worker slot bound again) before the next call that uses it.
Some writes move neither:

* **Optimizers that write through kernels of their own.** torch's fused
  optimizers (``torch.optim.AdamW(…, fused=True)``, which Hugging Face
  ``Trainer`` picks by default) update the parameters without bumping their
  version counters; ``foreach`` and for-loop implementations do bump them.
  A global optimizer step hook catches every ``torch.optim.Optimizer`` step,
  whatever its implementation: a parameter that had a gradient and whose
  version did not move during ``step()`` gets its counter bumped, exactly
  as the ``foreach`` implementation would have. Optimizers running on the
  worker (:class:`~remotorch.optim.RemoteOptimizer`) are left alone.
* **Writes through ``.data``** in place (``p.data.mul_(…)``, EMA updates,
  old weight-norm code): ``p.data`` is a tensor with a version counter of its
  own, and the address does not move. Nothing cheap can see these; say so
  with :func:`mark_changed`. (Swapping the storage, ``p.data = other``, is
  seen: the address moves.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch.autograd.graph import increment_version

_installed: list = []
_install_lock = threading.Lock()
_before = threading.local()  # id(optimizer) -> [(param, version)] between its pre and post hooks


def install_optimizer_hooks() -> None:
    """Register the global optimizer step hooks (once per process)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    with _install_lock:
        if not _installed:
            _installed.append(register_optimizer_step_pre_hook(_pre_step))
            _installed.append(register_optimizer_step_post_hook(_post_step))


def _pre_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if getattr(optimizer, "runs_remotely", False):
        return
    versions = [(p, p._version) for group in optimizer.param_groups for p in group["params"]
                if p.grad is not None]
    if not hasattr(_before, "steps"):
        _before.steps = {}
    _before.steps[id(optimizer)] = versions


def _post_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    steps = getattr(_before, "steps", None)
    versions = steps.pop(id(optimizer), None) if steps else None
    if not versions:
        return
    unmoved = [p for p, version in versions if p._version == version]
    if unmoved:
        increment_version(unmoved)


def mark_changed(*values: torch.Tensor | torch.nn.Module | Iterable) -> None:
    """Say that these tensors (or every parameter and buffer of these modules) changed locally.

    Needed only after writes torch does not count, above all in place through
    ``.data`` (``ema_p.data.mul_(d).add_(p.data, alpha=1 - d)``): the next
    call that uses them uploads the new values. Everything else (in-place ops,
    ``copy_`` under ``no_grad``, ``load_state_dict``, any ``torch.optim``
    optimizer, fused ones included) is seen without it. Bumps the tensors'
    version counters, as an in-place op would.
    """
    tensors: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.nn.Module):
            tensors.extend(value.parameters())
            tensors.extend(b for b in value.buffers() if b is not None)
        elif isinstance(value, torch.Tensor):
            tensors.append(value)
        else:
            for item in value:
                mark_changed(item)
    if tensors:
        with torch.no_grad():
            increment_version(tensors)
