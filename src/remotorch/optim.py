"""``remotorch.optim.RemoteOptimizer``: ``torch.optim`` running on the worker (see :mod:`remotorch.training.optim`)."""

from .training.optim import RemoteOptimizer

__all__ = ["RemoteOptimizer"]
