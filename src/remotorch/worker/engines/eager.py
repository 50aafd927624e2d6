"""The eager engine: run the aten graph op by op through FX's generated code, its arguments boxed.

The generated ``forward`` takes one list and empties it (``torch.fx.graph._BoxedCodeGen``, what
aot_autograd's boxed callables do), and drops each value after its last use, so a saved
activation or an input is freed as soon as the graph no longer needs it.
"""

from __future__ import annotations

import copy

import torch
import torch.fx
from torch.fx.graph import _BoxedCodeGen

from . import boxed


def available(device: torch.device) -> bool:
    return True


def compile(graph, device: torch.device, example_args, artifacts=None):
    module = graph.module.to(device)
    body = copy.deepcopy(module.graph)  # (the decoded graph is shared by every engine: left as it is)
    body.set_codegen(_BoxedCodeGen())
    forward = torch.fx.GraphModule(module, body).forward

    def run(args: list):  # (a bound method takes no attributes: this one carries the mark)
        return forward(args)

    return boxed(run)
