"""remotorch: run PyTorch graphs on a remote worker while writing ordinary PyTorch.

``torch.compile(model, backend="remotorch")`` runs each captured graph on a
worker; :func:`compile` gives explicit control; :class:`Session` says which
worker (an embedded loopback worker when none is configured).
:func:`accelerate` and :func:`remote_profile` run the same graphs on several
workers and engines and report where the time goes; :func:`explain` says how
a function splits into graphs.
"""

from __future__ import annotations

from . import errors
from . import optim  # RemoteOptimizer: torch.optim on the worker
from .capture.backend import compile, remotorch_backend
from .profile import accelerate, explain, remote_profile
from .client.session import Session, default_session
from .client.stream import QueueLimits
from .client.trace import trace
from .capture import backend as _backend
from .training.client import TrainingClient as _TrainingClient
from .training.clip import install as _install_clip
from .training.writes import install_optimizer_hooks as _install_optimizer_hooks, mark_changed
from .devtools import models  # example models (``from remotorch import models``)
from .weights import from_pretrained, init_empty_weights, load_state_dict, save  # weights on the worker

__all__ = ["QueueLimits", "Session", "accelerate", "compile", "default_session", "errors", "explain",
           "from_pretrained", "init_empty_weights", "load_state_dict", "mark_changed",
           "models", "optim", "save", "trace",
           "parallel", "pipeline", "remote_profile", "remotorch_backend"]
__version__ = "0.1.0"


def _register_backend() -> None:
    """Register "remotorch" with dynamo unless the installed entry point will."""
    from importlib.metadata import entry_points

    if any(ep.name == "remotorch" for ep in entry_points(group="torch_dynamo_backends")):
        return  # dynamo loads it through the entry point (also without this import)
    from torch._dynamo.backends.registry import lookup_backend, register_backend
    try:
        lookup_backend("remotorch")
    except Exception:
        register_backend(compiler_fn=remotorch_backend, name="remotorch")



def __getattr__(name: str):
    """``remotorch.pipeline`` and ``remotorch.parallel`` without importing them first (loaded on first use)."""
    if name in ("pipeline", "parallel"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'remotorch' has no attribute {name!r}")


_register_backend()
# the root wires the parts that must not import each other
_backend.default_runner = default_session  # what captured graphs run on when no session is given
Session.make_trainer = _TrainingClient  # how a session trains on a worker (client never imports training)
_install_optimizer_hooks()  # any torch.optim step, fused ones included, marks what it wrote
_install_clip()  # torch.nn.utils.clip_grad_norm_ over gradients a RemoteOptimizer keeps on its worker
