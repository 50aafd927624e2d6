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
