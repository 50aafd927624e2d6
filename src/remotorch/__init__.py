"""remotorch: run PyTorch graphs on a remote worker while writing ordinary PyTorch.

``torch.compile(model, backend="remotorch")`` runs each captured graph on a
worker; :func:`compile` gives explicit control; :class:`Session` says which
worker (an embedded loopback worker when none is configured).
:func:`accelerate` and :func:`remote_profile` run the same graphs on several
workers and engines and report where the time goes; :func:`explain` says how
a function splits into graphs.

Importing the package is light (no torch), so that the command line answers
at once: each public name is imported on its first use (:func:`__getattr__`),
and the parts that must not import each other are joined then (:func:`_wire`).
"""

from __future__ import annotations

import importlib

from . import errors
from .client import wiring as _wiring

__version__ = "0.1.0"

# Every public name but ``errors``: the module that holds it ("module:attribute"), or that is it.
# Each is imported on first use (``__getattr__``), so ``import remotorch`` stays light; a new
# public name is one line here.
_PUBLIC = {
    "QueueLimits": ".client.stream:QueueLimits",
    "Session": ".client.session:Session",
    "accelerate": ".profile.accelerate:accelerate",
    "compile": ".capture.backend:compile",
    "default_session": ".client.session:default_session",
    "explain": ".profile.explain:explain",
    "from_pretrained": ".weights:from_pretrained",  # weights on the worker
    "init_empty_weights": ".weights:init_empty_weights",
    "load_state_dict": ".weights:load_state_dict",
    "mark_changed": ".training.writes:mark_changed",
    "models": ".devtools.models",  # example models (``from remotorch import models``)
    "optim": ".optim",  # RemoteOptimizer: torch.optim on the worker
    "parallel": ".parallel",
    "pipeline": ".pipeline",
    "remote_profile": ".profile.profiler:remote_profile",
    "remotorch_backend": ".capture.backend:remotorch_backend",
    "save": ".weights:save",
    "trace": ".client.trace:trace",
}
__all__ = ["errors", *_PUBLIC]


def __getattr__(name: str):
    """A public name, imported on first use (the parts joined first); later uses find it directly."""
    target = _PUBLIC.get(name)
    if target is None:
        raise AttributeError(f"module 'remotorch' has no attribute {name!r}")
    _wire()
    module, _, attribute = target.partition(":")
    value = importlib.import_module(module, __name__)
    if attribute:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


_wired = False


def _wire() -> None:
    """Join the parts that must not import each other (once; repeating it is harmless).

    Runs on the first public name (:func:`__getattr__`) and at the end of the
    import of ``capture.backend`` and ``client.session`` (through
    :mod:`remotorch.client.wiring`). Each step is idempotent and takes no lock,
    so two threads that first import the parts together both run it, and the
    import of a part that calls back here while being imported finds itself
    in ``sys.modules``.
    """
    global _wired
    if _wired:
        return
    from .capture import backend, eager
    from .client.session import Session, default_session
    from .training.client import TrainingClient
    from .training.clip import install as install_clip
    from .training.writes import install_optimizer_hooks

    backend.default_runner = default_session  # what captured graphs run on when no session is given
    eager.install()  # eager calls on values kept on a worker become graphs (client never imports capture)
    Session.make_trainer = TrainingClient  # how a session trains on a worker (client never imports training)
    install_optimizer_hooks()  # any torch.optim step, fused ones included, marks what it wrote
    install_clip()  # torch.nn.utils.clip_grad_norm_ over gradients a RemoteOptimizer keeps on its worker
    _register_backend(backend.remotorch_backend)
    _wired = True


def _register_backend(backend) -> None:
    """Register "remotorch" with dynamo unless the installed entry point will."""
    from importlib.metadata import entry_points

    if any(ep.name == "remotorch" for ep in entry_points(group="torch_dynamo_backends")):
        return  # dynamo loads it through the entry point (also without this import)
    from torch._dynamo.backends.registry import lookup_backend, register_backend
    try:
        lookup_backend("remotorch")
    except Exception:
        register_backend(compiler_fn=backend, name="remotorch")


_wiring.hook = _wire
