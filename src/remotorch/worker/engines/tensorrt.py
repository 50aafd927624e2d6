"""The tensorrt engine: compile the aten graph with Torch-TensorRT (CUDA workers only).

Offered only where ``torch_tensorrt`` imports and the worker runs on CUDA. A
graph TensorRT cannot take raises here, which the worker reports as a compile
failure for this engine only.
"""

from __future__ import annotations

import importlib.util

import torch


def available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("torch_tensorrt") is not None


def compile(graph, device: torch.device, example_args, artifacts=None):
    import torch_tensorrt

    module = graph.module.to(device).eval()  # nn.Module.eval(): inference mode; no Python eval
    compiled = torch_tensorrt.compile(module, ir="dynamo", arg_inputs=list(example_args),
                                      min_block_size=1)
    with torch.no_grad():
        compiled(*example_args)  # build the engine now, so building is not mixed into run timings
    return compiled
