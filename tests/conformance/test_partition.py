"""remotorch partitions forward and backward as aot_eager does: each forward saves as many values.

aot_eager splits the joint graph with the min-cut partitioner
(``min_cut_rematerialization_partition``: it recomputes in the backward what is cheaper to
recompute than to keep), and so does remotorch's capture. For every model of the conformance
zoo in training (``remotorch.devtools.zoo``), the forward graphs of one training call save the
same number of values (tensors and sizes) under both. The graphs are traced here, for a CPU
worker, and run here (nothing needs a worker for the count).

Each model is traced twice for training, which takes minutes for the whole zoo on a small
machine: the suite takes the first model of each family and GPT-2 (the model of the GPU
targets); ``REMOTORCH_ZOO_ALL=1`` takes every model of the suite's zoo.
"""

from __future__ import annotations

import os

import pytest
import torch

from remotorch.capture import backend
from remotorch.devtools import zoo
from remotorch.devtools.conformance import synthetic_loss

from capture_helpers import StubWorker

def _specs() -> list[str]:
    suite = zoo.suite()
    if os.environ.get("REMOTORCH_ZOO_ALL") == "1":
        return [spec.name for spec in suite]
    firsts = [next(spec.name for spec in suite if spec.family == family) for family in zoo.FAMILIES]
    return firsts + [name for name in ("GPT2LMHeadModel",) if name not in firsts]


SPECS = _specs()


class _LocalWorker(StubWorker):
    """Runs each captured graph here (it was traced for this CPU)."""

    def run_graph(self, graph, args):
        return list(graph._local(*args))


def _saved(graph_outputs: int, first_saved: int | None) -> int:
    return graph_outputs - (first_saved if first_saved is not None else graph_outputs)


def _call(spec, compiled) -> None:
    inputs = spec.inputs()
    extra = spec.labels(inputs) if spec.labels else {}
    out = compiled(**inputs, **extra)
    loss = out.loss if spec.labels else synthetic_loss(out)
    loss.backward()


def saved_by_aot_eager(spec) -> list[int]:
    """Values each forward graph saves for its backward under ``aot_eager`` (its own configuration; an
    inference graph, made where nothing needs a gradient, saves none)."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop
    from torch._guards import TracingContext

    counts = []

    def forward(gm, example_inputs):
        meta = TracingContext.get().fw_metadata
        n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        counts.append(_saved(n_out, meta.num_forward))
        return boxed_nop(gm, example_inputs)

    torch._dynamo.reset()
    model = spec.build().train()
    _call(spec, torch.compile(model, backend=lambda gm, ex: aot_eager(gm, ex, fw_compiler=forward)))
    torch._dynamo.reset()
    return counts


def saved_by_remotorch(spec) -> list[int]:
    """Values each forward graph remotorch captures saves for its backward."""
    made = []

    class Recorded(backend.RemoteGraph):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            if self.kind != "backward":  # (aot_eager compiles inference graphs with its forward compiler)
                made.append(self)

    torch._dynamo.reset()
    runner = _LocalWorker(device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "RemoteGraph", Recorded)
        model = spec.build().train()
        _call(spec, torch.compile(model, backend=lambda gm, ex: backend.remotorch_backend(
            gm, ex, session=runner, fallback="raise")))
    torch._dynamo.reset()
    return [_saved(len(g.output_devices), g.saved_from) for g in made]


@pytest.mark.parametrize("name", SPECS)
def test_each_forward_saves_as_many_values_as_under_aot_eager(name):
    spec = zoo.by_name(name)
    try:
        reference = saved_by_aot_eager(spec)
    except Exception as exc:  # the comparison is with what aot_eager does: nothing to compare
        pytest.skip(f"aot_eager fails: {type(exc).__name__}: {str(exc)[:200]}")
    got = saved_by_remotorch(spec)
    assert reference and got == reference
