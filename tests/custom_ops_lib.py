"""A library of custom operators for tests: what a worker imports with ``remotorch serve --import``.

It registers namespace ``rmtest_lib`` with ``torch.library`` the way real
libraries do (a kernel, a fake implementation for tracing, an autograd
formula), plus an operator that writes into its argument, which workers must
refuse to run from a document even in an allowed namespace.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("rmtest_lib::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """``x + alpha * y``, opaque to tracing."""
    return x + alpha * y


@scaled_add.register_fake
def _scaled_add_fake(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_add_backward(ctx, grad):
    return grad, grad * ctx.alpha, None


def _scaled_add_setup(ctx, inputs, output):
    ctx.alpha = inputs[2]


scaled_add.register_autograd(_scaled_add_backward, setup_context=_scaled_add_setup)


@torch.library.custom_op("rmtest_lib::fill_ones_", mutates_args=("x",))
def fill_ones_(x: torch.Tensor) -> None:
    """Writes into its argument: never run from a graph document."""
    x.fill_(1.0)


@fill_ones_.register_fake
def _fill_ones_fake(x: torch.Tensor) -> None:
    return None
