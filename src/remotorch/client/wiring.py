"""The hook that joins the parts which must not import each other, run by the parts themselves.

The package root (``remotorch/__init__.py``) imports nothing heavy, so that
the command line answers at once (``remotorch top`` never imports torch). It
sets :data:`hook` to its ``_wire``, which joins the parts: the default session
captured graphs run on, the training client a session trains with, and the
global ``torch.optim`` and ``clip_grad_norm_`` hooks. ``remotorch.capture.backend``
and ``remotorch.client.session`` call :func:`ensure` as the last step of
their import, so the parts are joined however a program reached them: a
public name of the package (``remotorch.compile``), a module of it (``from
remotorch.optim import RemoteOptimizer``, ``from remotorch.pipeline import
Pipeline``), or ``torch.compile(backend="remotorch")`` through the installed
entry point without importing remotorch at all. This module imports nothing,
so any part may call it without depending on the parts it joins.
"""

from __future__ import annotations

from collections.abc import Callable

#: Joins the parts (idempotent); set by the package root, which Python always imports first.
hook: Callable[[], None] | None = None


def ensure() -> None:
    """Join the parts now, unless done already (cheap to repeat)."""
    if hook is not None:
        hook()
