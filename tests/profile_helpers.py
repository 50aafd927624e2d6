"""Helpers shared by the profiling tests: capture one aten graph as a RemoteGraph; recorded calls and their report."""

from __future__ import annotations

import torch

from remotorch.capture.graph import RemoteGraph, output_devices
from remotorch.codec.graph import encode_graph
from remotorch.profile.records import BackendRun, CallRecord, GraphCall, ProfileSettings
from remotorch.profile.report import build_report

BACKENDS = ["w/eager", "w/onnxrt"]


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


def report_of(records, backends=BACKENDS, workers=None):
    """The report of these records, as a profile of ``backends`` with 1 warm-up and 3 repeats."""
    return build_report(records, ProfileSettings(backends, backends[0], 3, 1, workers or {"w": {"price_per_hour": 7.2}}))


def call(function, graphs, *, start=0.0, gaps=(), compiled=False, error=None, times=None):
    """A call whose local segments last ``gaps`` ms and whose graphs ran the given times."""
    rec = CallRecord(function, start, compiled=compiled)
    t = start
    for i, gid in enumerate(graphs):
        t += gaps[i] / 1e3
        runs = {b: BackendRun(times_ms=list(times[b]) if times and not (error and b == error[0]) else [],
                              error=error[1] if error and b == error[0] else None, network_ms=0.5)
                for b in BACKENDS}
        rec.graphs.append(GraphCall(gid, 3, t, t + 0.010, runs))
        t += 0.010
    rec.end = t + gaps[len(graphs)] / 1e3
    return rec
