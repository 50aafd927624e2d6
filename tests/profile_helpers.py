"""Helpers shared by the profiling tests: capture one aten graph as a RemoteGraph."""

from __future__ import annotations

import torch

from remotorch.capture.graph import RemoteGraph, output_devices
from remotorch.codec.graph import encode_graph


def capture_graph(fn, *args, dynamic: bool = False) -> tuple[RemoteGraph, list]:
    """The first aten graph ``fn(*args)`` produces, and the flat arguments it was called with."""
    from torch._dynamo.backends.common import aot_autograd

    found: list = []

    def keep(gm, example_inputs):
        found.append(gm)

        def run(*flat):
            flat = flat[0] if len(flat) == 1 and isinstance(flat[0], list) else list(flat)
            if not seen:  # the flat arguments of the first run of the first graph
                seen.append(list(flat))
            return gm(*flat)

        run._boxed_call = True
        return run

    seen: list = []
    backend = aot_autograd(fw_compiler=keep, inference_compiler=keep)
    with torch.no_grad():
        torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    gm = found[0]
    graph = RemoteGraph(encode_graph(gm), runner=lambda: None, engine="eager", fallback="raise",
                        resident=[], output_devices=output_devices(gm), local=gm.forward)
    return graph, seen[0]
