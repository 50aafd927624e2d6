"""Every model of the conformance zoo, in each of its modes, on remotorch equals the same code under aot_eager.

The zoo (``remotorch.devtools.zoo``) builds real ``transformers`` and
``diffusers`` architectures from tiny configs; each case
(``remotorch.devtools.conformance``) is ordinary user code: a forward pass,
greedy ``generate`` with a KV cache on a left-padded batch, or two AdamW
training steps with ``labels=``. On remotorch it runs inside ``with
Session()`` against one real ``remotorch serve --allow-ops transformers``
with ``fallback="raise"``, and its results are read after the block closed
the session. The aot_eager reference runs in a second process meanwhile
(``zoo_references``). ``python benchmarks/conformance.py`` runs the same
cases for the whole zoo (the suite's 42 architectures and 19 close
relatives) and writes docs/models.md.
"""

from __future__ import annotations

import pytest
import torch

import remotorch
from remotorch.devtools import conformance, zoo

from conftest import TOKEN

CASES = [(spec.name, mode) for spec in zoo.suite() for mode in spec.modes]


def test_the_suite_spans_forty_architectures_and_every_family():
    specs = zoo.suite()
    assert len({s.name for s in specs}) == len(specs) >= 40
    assert {s.family for s in specs} == set(zoo.FAMILIES)
    assert sum(1 for s in specs if s.generate) >= 20
    assert all(s.allow_ops == ("transformers",) for s in specs if s.family == "moe")
    assert zoo.EXTENDED < {s.name for s in zoo.specs()}  # the benchmark's extra models exist


@pytest.mark.parametrize("case", CASES, ids=[f"{name}-{mode}" for name, mode in CASES])
def test_remotorch_equals_aot_eager(case, zoo_worker, zoo_references):
    name, mode = case
    got = conformance.run_case(zoo.by_name(name), mode, "remotorch",
                               lambda: remotorch.Session(zoo_worker.url, token=TOKEN))
    reference = zoo_references.get(name, mode)
    if not reference.ok:
        pytest.skip(f"aot_eager fails too: {reference.error}")
    assert got.ok, got.error
    assert got.remote_calls > 0 and got.fallbacks == 0, (got.remote_calls, got.fallbacks)
    why = conformance.compare(reference, got)
    assert why is None, f"{name} {mode}: {why}"


# a decoder's training and generation, a mixture of experts (library operators), a convolutional net
BLOCKING_CASES = [("GPT2LMHeadModel", "train"), ("GPT2LMHeadModel", "generate"), ("MixtralForCausalLM", "train"),
                  ("ResNetForImageClassification", "train")]


@pytest.mark.parametrize("case", BLOCKING_CASES, ids=[f"{name}-{mode}" for name, mode in BLOCKING_CASES])
def test_blocking_mode_gives_the_same_bits_as_the_default(case, zoo_worker):
    """``Session(blocking=True)`` (``REMOTORCH_LAUNCH_BLOCKING=1``) waits for every reply; the queued
    default must compute exactly the same values, bit for bit."""
    name, mode = case
    spec = zoo.by_name(name)
    queued = conformance.run_case(spec, mode, "remotorch", lambda: remotorch.Session(zoo_worker.url, token=TOKEN))
    blocking = conformance.run_case(spec, mode, "remotorch",
                                    lambda: remotorch.Session(zoo_worker.url, token=TOKEN, blocking=True))
    assert queued.ok and blocking.ok, (queued.error, blocking.error)
    assert queued.values.keys() == blocking.values.keys() and queued.values
    for key, value in queued.values.items():
        assert torch.equal(value, blocking.values[key]) or (
            value.is_floating_point() and torch.allclose(value, blocking.values[key], rtol=0, atol=0, equal_nan=True)
        ), key
