"""The worker: graph cache, tensor store, engines. Usable in-process, without sockets."""

from .worker import Worker, resolve_device

__all__ = ["Worker", "resolve_device"]
